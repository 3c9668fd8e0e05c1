#!/usr/bin/env bash
# One command for a GPU machine: installs the wheels brought along into a temporary site, then runs
# the engine's CUDA tests (tests/cuda), the launcher training model=dlrm_torch on CUDA through every
# plan (tests/cuda/test_cuda_launcher.py), megatron-core's DDP against torch DDP
# (tests/cuda/test_cuda_megatron.py), the GPU overlap benchmark (scripts/bench_gpu.py) and the
# engine benchmark (scripts/bench_engine.py), each under a time limit (570 s together, so one
# 10-minute device call always ends with the summary), and prints one summary table.
# Needs a python with CUDA torch, pytest and hypothesis, plus the wheels of what else is imported
# (scripts/gpu_wheels.sh prepares them on a machine with a package index: nvtx for the engine, the
# launcher's config stack and megatron-core for the training steps). Logs, the benchmarks' JSON and
# summary.txt go to --out (default: $OUT if set, else runs/gpu_check/<time>). README, section
# "GPU", has the device tool command.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  cat <<'EOF'
usage: scripts/gpu_check.sh [--out DIR] [--wheels DIR] [--python PY] [--quick]

  --out DIR     where the logs, bench_*.json and summary.txt go
                (default: $OUT if set, else runs/gpu_check/<time>)
  --wheels DIR  wheels to install into a temporary site first, without an index
                (default: wheels/ in the repository, if it exists)
  --python PY   the interpreter with CUDA torch, pytest and hypothesis (default: python3)
  --quick       short benchmark runs: a smoke test of the whole sequence
  -h, --help    this text

exit status: 0 every step passed; 1 a step failed or ran out of time;
             2 bad arguments, or the engine cannot be imported after installing the wheels;
             3 no CUDA GPU is visible (nothing was run)
EOF
}

bad_usage() {
  echo "gpu_check: $1 (see --help)" >&2
  exit 2
}

OUT_DIR="${OUT:-}"
WHEELS=""
PY="python3"
QUICK=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out | --wheels | --python)
      [[ $# -ge 2 && -n "$2" ]] || bad_usage "$1 needs a value"
      case "$1" in
        --out) OUT_DIR="$2" ;;
        --wheels) WHEELS="$2" ;;
        --python) PY="$2" ;;
      esac
      shift 2
      ;;
    --quick) QUICK=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) bad_usage "unknown argument '$1'" ;;
  esac
done
if [[ -n "$WHEELS" && ! -d "$WHEELS" ]]; then
  bad_usage "--wheels $WHEELS is not a directory"
fi
if [[ -z "$WHEELS" && -d "$ROOT/wheels" ]]; then
  WHEELS="$ROOT/wheels"
fi
command -v "$PY" >/dev/null 2>&1 || bad_usage "python '$PY' not found"

# -- is there a GPU? (before anything is installed or run) ------------------------------------------
probe="$("$PY" -c '
import torch
print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), sep="|")
' 2>&1)" || {
  echo "gpu_check: '$PY' cannot import torch: ${probe##*$'\n'}; nothing was run" >&2
  exit 3
}
# the last line is the answer (torch may warn on stderr before it)
IFS='|' read -r torch_version cuda_build cuda_available <<<"${probe##*$'\n'}"
if [[ "$cuda_available" != "True" ]]; then
  echo "gpu_check: no CUDA GPU is visible to $PY (torch $torch_version, CUDA build $cuda_build); nothing was run." >&2
  echo "gpu_check: run this on a GPU machine (README, section GPU)." >&2
  exit 3
fi

if [[ -z "$OUT_DIR" ]]; then
  OUT_DIR="$ROOT/runs/gpu_check/$(date +%Y%m%d-%H%M%S)"
fi
mkdir -p "$OUT_DIR" || bad_usage "cannot create --out $OUT_DIR"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# -- the wheels brought along, into a temporary site -------------------------------------------------
SITE="$WORK/site"
mkdir -p "$SITE"
shopt -s nullglob
wheels=()
if [[ -n "$WHEELS" ]]; then
  wheels=("$WHEELS"/*.whl)
fi
shopt -u nullglob
if ((${#wheels[@]})); then
  echo "[gpu_check] installing ${#wheels[@]} wheel(s) from $WHEELS into a temporary site"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --root-user-action=ignore --target "$SITE" "${wheels[@]}" >"$WORK/pip.log" 2>&1; then
    echo "gpu_check: the wheels in $WHEELS did not install:" >&2
    tail -n 20 "$WORK/pip.log" >&2
    exit 2
  fi
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# the training tests fail (instead of skipping) where a package they need was not brought along
export RECSYS_GPU_CHECK=1
if ! engine_error="$("$PY" -c 'import recsys_pipe.engine' 2>&1)"; then
  echo "gpu_check: the engine does not import here: ${engine_error##*$'\n'}" >&2
  echo "gpu_check: bring the missing wheels (scripts/gpu_wheels.sh) and pass --wheels DIR" >&2
  exit 2
fi

# -- the steps ---------------------------------------------------------------------------------------
STEPS="$WORK/steps.tsv"
: >"$STEPS"

# run_step NAME LIMIT_S COMMAND...: runs COMMAND in the repository root under a time limit, output
# to $OUT_DIR/NAME.log; records "NAME<TAB>status<TAB>seconds" in $STEPS.
run_step() {
  local name="$1" limit="$2"
  shift 2
  local log="$OUT_DIR/$name.log" start=$SECONDS rc status
  echo "[gpu_check] $name: running (limit ${limit} s)"
  (cd "$ROOT" && timeout --kill-after=15 "$limit" "$@") >"$log" 2>&1
  rc=$?
  case $rc in
    0) status="passed" ;;
    124 | 137) status="timed out after ${limit} s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" >>"$STEPS"
  echo "[gpu_check] $name: $status in $((SECONDS - start)) s (log: $log)"
  if [[ $rc -ne 0 ]]; then
    tail -n 30 "$log" | sed 's/^/    /'
  fi
}

# last_json LOG OUT: the benchmark's last output line (its JSON report), if it is one
last_json() {
  tail -n 1 "$1" | grep '^{' >"$2" || rm -f "$2"
}

bench_args=()
if ((QUICK)); then
  bench_args=(--quick)
fi

TRAINING_TESTS=(tests/cuda/test_cuda_launcher.py tests/cuda/test_cuda_megatron.py)
run_step cuda_tests 180 "$PY" -m pytest tests/cuda -q -rs -p no:cacheprovider \
  "${TRAINING_TESTS[@]/#/--ignore=}"
run_step launcher_cuda 120 "$PY" -m pytest "${TRAINING_TESTS[0]}" -q -rs -p no:cacheprovider
run_step megatron_cuda 60 "$PY" -m pytest "${TRAINING_TESTS[1]}" -q -rs -p no:cacheprovider
run_step bench_gpu 120 "$PY" scripts/bench_gpu.py ${bench_args[@]+"${bench_args[@]}"}
last_json "$OUT_DIR/bench_gpu.log" "$OUT_DIR/bench_gpu.json"

engine_args=(${bench_args[@]+"${bench_args[@]}"})
PLANS_NOTE=""
# The plan section composes the shipped plans through the launcher config (Hydra, pydantic, the
# model registry): probe exactly that, since the training stack may be partly absent here.
probe='from recsys_pipe.testing import load_run
from recsys_pipe.train import training_plan
training_plan(load_run("pipeline=hstu_prefetch"), resolve_fn=lambda path: print)'
if ! plans_error="$("$PY" -c "$probe" 2>&1)"; then
  engine_args+=(--no-plans)
  PLANS_NOTE="shipped plans skipped: ${plans_error##*$'\n'}"
fi
run_step bench_engine 90 "$PY" scripts/bench_engine.py ${engine_args[@]+"${engine_args[@]}"}
last_json "$OUT_DIR/bench_engine.log" "$OUT_DIR/bench_engine.json"

# -- one summary --------------------------------------------------------------------------------------
GPU_INFO="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)"
"$PY" - "$OUT_DIR" "$STEPS" "$GPU_INFO" "$PLANS_NOTE" <<'PYTHON'
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

out, steps_file, gpu_info, plans_note = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]


def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None


def med(entry):
    return entry["median"]


def tests_result(name):
    log = out / f"{name}.log"
    lines = [line for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    return lines[-1].strip("= ") if lines else "no output"


def bench_gpu_result():
    r = load("bench_gpu.json")
    if r is None:
        return "no report"
    c = r["configs"]
    seq, thr = c["pipelined_sequential"], c["pipelined_threaded"]
    o = r["overhead_us_per_task"]
    if not r["targets"]["evaluated"]:
        verdict = "targets not evaluated: " + r["targets"]["reason"]
    else:
        missed = [k for k, v in r["targets"]["met"].items() if v is False]
        verdict = "targets " + ("all met" if not missed else "missed: " + ", ".join(missed))
    return (
        f"serial {med(c['serial']['iteration_ms'])} ms, pipelined {med(seq['iteration_ms'])} / "
        f"{med(thr['iteration_ms'])} ms (seq / thr); ÷ ideal {med(seq['ratio_vs_ideal'])} / "
        f"{med(thr['ratio_vs_ideal'])}; speedup {med(seq['speedup_vs_serial'])} / {med(thr['speedup_vs_serial'])}; "
        f"off-default share {med(r['off_default_share_of_serial'])}; host µs/task {med(o['sequential'])} / "
        f"{med(o['threaded'])}; {verdict}"
    )


def bench_engine_result():
    r = load("bench_engine.json")
    if r is None:
        return "no report"
    text = (
        f"sequential {med(r['sequential']['overhead_us_per_task'])} µs/task, threaded "
        f"{med(r['threaded']['overhead_us_per_task'])} µs/task, overlap ÷ ideal {med(r['overlap']['ratio_vs_ideal'])}"
    )
    return text + (f" ({plans_note})" if plans_note else "")


results = {
    "cuda_tests": lambda: tests_result("cuda_tests"),
    "launcher_cuda": lambda: tests_result("launcher_cuda"),
    "megatron_cuda": lambda: tests_result("megatron_cuda"),
    "bench_gpu": bench_gpu_result,
    "bench_engine": bench_engine_result,
}
rows = [line.split("\t") for line in steps_file.read_text().splitlines()]
header = (
    f"gpu_check on {gpu_info or (torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no visible GPU')}; torch {torch.__version__} (CUDA {torch.version.cuda}), "
    f"python {platform.python_version()}; {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
)
lines = [header, f"{'step':<14} {'status':<26} {'s':>5}  result"]
for name, status, seconds in rows:
    lines.append(f"{name:<14} {status:<26} {seconds:>5}  {results[name]()}")
lines.append(f"{'profiler':<14} {'not run':<26} {'-':>5}  the task profiler has not landed on this branch")
passed = all(status == "passed" for _, status, _ in rows)
lines.append("overall: " + ("PASSED" if passed else "FAILED"))
text = "\n".join(lines)
(out / "summary.txt").write_text(text + "\n")
print(text)
sys.exit(0 if passed else 1)
PYTHON
