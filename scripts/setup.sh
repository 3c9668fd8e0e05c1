#!/usr/bin/env bash
# Creates .venv at the repo root and installs recsys_pipe with its training stack.
# Idempotent: a stamp file keyed on this script and pyproject.toml makes re-runs instant.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
STAMP="$VENV/.recsys_pipe_stamp"
EXTRAS="test,docs,megatron"
UV_VERSION="0.13.9"
want="$(cat "$ROOT/scripts/setup.sh" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# The installer: uv where it installs (the same pins as pip, unpacked and compiled to bytecode in
# parallel: the set-up in about 25 s against pip's 48 on a 2-core machine), else pip.
if pip install "uv==$UV_VERSION" 2>/dev/null; then
  # uv reads its own settings, not pip's: it gets pip's find-links (a folder of wheels that no
  # index has, such as the CPU torch of a machine without a network) and writes the bytecode that
  # an interpreter run with PYTHONDONTWRITEBYTECODE would otherwise compile at every start.
  links=()
  for link in ${PIP_FIND_LINKS:-$(pip config get global.find-links 2>/dev/null || true)}; do
    links+=(--find-links "$link")
  done
  # (a step uv fails, pip tries again: the same requirements, pip's own resolution)
  install() { "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --compile-bytecode ${links[@]+"${links[@]}"} "$@" || pip install "$@"; }
  uninstall() { "$VENV/bin/uv" pip uninstall -q --python "$VENV/bin/python" "$@"; }
else
  pip install --upgrade pip setuptools wheel
  install() { pip install "$@"; }
  uninstall() { pip uninstall -y "$@"; }
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] CUDA machine: installing CUDA builds" >&2
  install "torch==2.13.0" "fbgemm-gpu==1.8.0" "torchrec==1.8.0"
  install -e "$ROOT[$EXTRAS]"
else
  echo "[setup] no CUDA: installing the CPU stack" >&2
  # A torchrec installed by an earlier run would make the installer check its dependency list.
  uninstall torchrec 2>/dev/null || true
  # The CPU wheels of torch and fbgemm-gpu (a bare `torch` requirement would pull the multi-GB
  # CUDA build), torchrec's own runtime requirements (its list names the CUDA fbgemm-gpu), then
  # this project's, read from pyproject.toml, less torch and torchrec...
  # shellcheck disable=SC2046  # one requirement per word
  # triton: the version whose interpreter the CPU tests of the Triton attention were written
  # against (a CUDA torch brings its own, pinned by torch)
  install "torch==2.13.0" "fbgemm-gpu-cpu==1.8.0" "triton==3.9.0" tensordict torchmetrics iopath pyre-extensions typing-inspect $("$VENV/bin/python" "$ROOT/scripts/requirements.py" "$ROOT/pyproject.toml" \
    --extras "$EXTRAS" --without torch torchrec)
  # ...then torchrec and the project without dependency resolution. Installed last, so no later
  # install checks torchrec's list and complains that the CUDA fbgemm-gpu is missing.
  install --no-deps "torchrec==1.8.0"
  install --no-deps -e "$ROOT"
fi
echo "$want" > "$STAMP"
echo "[setup] done: $VENV (source .venv/bin/activate to put recsys-train, recsys-plan, recsys-profile, recsys-eval, recsys-export on PATH)" >&2
