#!/usr/bin/env bash
# Creates .venv at the repo root and installs recsys_pipe with its training stack.
# Idempotent: a stamp file keyed on this script and pyproject.toml makes re-runs instant.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
STAMP="$VENV/.recsys_pipe_stamp"
want="$(cat "$ROOT/scripts/setup.sh" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip setuptools wheel

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] CUDA machine: installing CUDA builds" >&2
  pip install "torch==2.13.0" fbgemm-gpu==1.8.0
  pip install torchrec==1.8.0
else
  echo "[setup] no CUDA: installing the CPU stack" >&2
  # A bare `torch` requirement would pull the multi-GB CUDA build; pin the CPU wheel.
  pip install "torch==2.13.0" "fbgemm-gpu-cpu==1.8.0"
fi
pip install tensordict torchmetrics tqdm pyre-extensions iopath typing-inspect
pip install "megatron-core==0.16.1"
pip install -e "$ROOT[test]"
if [[ -z "$(command -v nvidia-smi)" ]] || ! nvidia-smi -L >/dev/null 2>&1; then
  # torchrec declares a dependency on the CUDA fbgemm-gpu; on CPU it runs on fbgemm-gpu-cpu, so
  # it is installed without deps (its real runtime dependencies are above) and last: any pip
  # install after it would print a resolver ERROR about the fbgemm-gpu it does not need.
  pip install --no-deps "torchrec==1.8.0"
fi
echo "$want" > "$STAMP"
echo "[setup] done: $VENV (source .venv/bin/activate to put recsys-train, recsys-plan, recsys-profile on PATH)" >&2
