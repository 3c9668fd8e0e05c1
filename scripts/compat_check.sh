#!/usr/bin/env bash
# Checks the project against the torchrec stack of the GPU machine it will meet: builds a second
# virtual environment (.venv-compat, ignored by git; .venv and scripts/setup.sh are untouched)
# with torch 2.11.0, fbgemm-gpu-cpu 1.6.0 and torchrec 1.6.1 -- the release pairing of a machine
# whose image ships torch 2.11 (fbgemm-gpu 1.6.0 is the CUDA build for it) -- and runs the tests
# that drive torchrec there: the 2-rank training and model parity runs, sharding, the models, the
# batches, the trainer and resume. Not part of the default test run: the first build downloads
# about 3 GB and the parity runs take minutes on 2 cores.
#
#   bash scripts/compat_check.sh [--venv DIR] [--setup-only] [PYTEST_ARG ...]
#
#   --venv DIR     the environment to build and use (default: .venv-compat in the repository)
#   --setup-only   build the environment, print its versions, run nothing
#   PYTEST_ARG     replace the default test selection, e.g. tests/integration/test_sharding.py -k planner
#
# PyPI publishes torch 2.11.0 for Linux x86-64 only as its CUDA 13 build (the CPU build lives on
# PyTorch's own index): pip installs that build with its CUDA libraries, and with no GPU visible it
# runs on CPU exactly like a CPU build. Set TORCH_INDEX_URL (e.g. PyTorch's CPU index) to install
# torch from another index instead. torchrec is installed without its dependencies (it requires
# the CUDA fbgemm-gpu, which fbgemm-gpu-cpu replaces here); its runtime dependencies are named.
# The environment is rebuilt only when the versions above or pyproject.toml change.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-compat"
PY="${PYTHON:-python3}"
TORCH_VERSION=2.11.0
FBGEMM_VERSION=1.6.0
TORCHREC_VERSION=1.6.1
# what torchrec and the project import beyond torch, at the versions brought to the GPU machine
RUNTIME_DEPS=(
  tensordict==0.15.3 pyvers==0.2.3 cloudpickle iopath==0.1.9 portalocker
  torchmetrics==1.9.0 tqdm pyre-extensions typing-inspect megatron-core==0.16.1
)
# every test that imports torchrec or trains a torchrec model (the multi-process ones included)
DEFAULT_TESTS=(
  tests/integration/test_train_parity.py tests/integration/test_model_parity.py tests/integration/test_sharding.py
  tests/unit/test_models_hstu.py tests/unit/test_models_dlrm.py tests/unit/test_data.py
  tests/unit/test_train_lifecycle.py tests/integration/test_resume.py tests/integration/test_dense_ddp.py
  tests/integration/test_launcher_torchrec.py tests/integration/test_bench_train.py
)

SETUP_ONLY=0
pytest_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --venv)
      [[ $# -ge 2 && -n "$2" ]] || { echo "compat_check: --venv needs a directory" >&2; exit 2; }
      VENV="$2"
      shift 2
      ;;
    --setup-only) SETUP_ONLY=1; shift ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) pytest_args+=("$1"); shift ;;
  esac
done

STAMP="$VENV/.recsys_pipe_compat_stamp"
# keyed on what is installed (not on the test selection): editing the tests rebuilds nothing
want="$({ echo "$TORCH_VERSION $FBGEMM_VERSION $TORCHREC_VERSION ${RUNTIME_DEPS[*]} ${TORCH_INDEX_URL:-}"; cat "$ROOT/pyproject.toml"; } | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
  start=$SECONDS
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
  constraints="$VENV/compat-constraints.txt"
  # keeps every later install from moving torch off the version under test
  echo "torch==$TORCH_VERSION" >"$constraints"
  pip install --upgrade pip setuptools wheel
  echo "[compat] installing torch $TORCH_VERSION" >&2
  if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
  else
    pip install "torch==$TORCH_VERSION"
  fi
  echo "[compat] installing fbgemm-gpu-cpu $FBGEMM_VERSION, torchrec $TORCHREC_VERSION and their dependencies" >&2
  pip install -c "$constraints" "fbgemm-gpu-cpu==$FBGEMM_VERSION"
  # as scripts/setup.sh does on CPU: a torchrec already here would make pip check its dependency
  # list (the CUDA fbgemm-gpu); the dependencies first, torchrec and the project last, unresolved
  pip uninstall -y torchrec >/dev/null 2>&1 || true
  pip install -c "$constraints" "${RUNTIME_DEPS[@]}"
  # shellcheck disable=SC2046  # one requirement per word
  pip install -c "$constraints" $("$VENV/bin/python" "$ROOT/scripts/requirements.py" "$ROOT/pyproject.toml" \
    --extras test --without torch torchrec)
  pip install --no-deps "torchrec==$TORCHREC_VERSION"
  pip install --no-deps -e "$ROOT"
  echo "$want" >"$STAMP"
  echo "[compat] environment built in $((SECONDS - start)) s: $VENV" >&2
fi

# the versions really installed, checked: a resolver surprise must not pass as a compat run
"$VENV/bin/python" - "$TORCH_VERSION" "$FBGEMM_VERSION" "$TORCHREC_VERSION" <<'PYTHON'
import sys
from importlib.metadata import version

want = dict(zip(("torch", "fbgemm-gpu-cpu", "torchrec"), sys.argv[1:]))
got = {name: version(name) for name in want}
import fbgemm_gpu  # noqa: E402,F401  (loads the operator library against this torch)
import torch  # noqa: E402
import torchrec  # noqa: E402,F401

print("[compat] " + ", ".join(f"{n} {v}" for n, v in got.items()) + f" (torch CUDA build {torch.version.cuda})")
wrong = [f"{n} {got[n]} (wanted {v})" for n, v in want.items() if got[n].split("+")[0] != v]
if wrong:
    sys.exit("compat_check: wrong versions installed: " + ", ".join(wrong))
PYTHON

((SETUP_ONLY)) && exit 0
((${#pytest_args[@]})) || pytest_args=(-q -p no:cacheprovider "${DEFAULT_TESTS[@]}")
cd "$ROOT"
start=$SECONDS
set +e
"$VENV/bin/python" -m pytest "${pytest_args[@]}"
rc=$?
set -e
echo "[compat] pytest exit $rc after $((SECONDS - start)) s on torch $TORCH_VERSION / fbgemm-gpu-cpu $FBGEMM_VERSION / torchrec $TORCHREC_VERSION" >&2
exit $rc
