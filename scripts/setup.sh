#!/usr/bin/env bash
# Creates .venv at the repo root and installs recsys_pipe with its training stack.
# Idempotent: a stamp file keyed on this script and pyproject.toml makes re-runs instant.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
STAMP="$VENV/.recsys_pipe_stamp"
EXTRAS="test,docs,megatron"
want="$(cat "$ROOT/scripts/setup.sh" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip setuptools wheel

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] CUDA machine: installing CUDA builds" >&2
  pip install "torch==2.13.0" "fbgemm-gpu==1.8.0" "torchrec==1.8.0"
  pip install -e "$ROOT[$EXTRAS]"
else
  echo "[setup] no CUDA: installing the CPU stack" >&2
  # A bare `torch` requirement would pull the multi-GB CUDA build: pin the CPU wheel.
  pip install "torch==2.13.0" "fbgemm-gpu-cpu==1.8.0"
  # A torchrec installed by an earlier run would make pip check its dependency list below.
  pip uninstall -y torchrec 2>/dev/null || true
  # torchrec's own runtime requirements (its list names the CUDA fbgemm-gpu, installed above as
  # fbgemm-gpu-cpu), then this project's, read from pyproject.toml, less torch and torchrec...
  pip install tensordict torchmetrics iopath pyre-extensions typing-inspect
  # shellcheck disable=SC2046  # one requirement per word
  pip install $("$VENV/bin/python" "$ROOT/scripts/requirements.py" "$ROOT/pyproject.toml" \
    --extras "$EXTRAS" --without torch torchrec)
  # ...then torchrec and the project without dependency resolution. Installed last, so no later
  # pip run checks torchrec's list and complains that the CUDA fbgemm-gpu is missing.
  pip install --no-deps "torchrec==1.8.0"
  pip install --no-deps -e "$ROOT"
fi
echo "$want" > "$STAMP"
echo "[setup] done: $VENV (source .venv/bin/activate to put recsys-train, recsys-plan, recsys-profile on PATH)" >&2
