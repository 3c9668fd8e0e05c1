#!/usr/bin/env bash
# One command for a GPU machine: installs the wheels brought along into a temporary site, then runs
# the engine's CUDA tests (tests/cuda), the launcher training model=dlrm_torch on CUDA through every
# plan (tests/cuda/test_cuda_launcher.py), megatron-core's DDP against torch DDP
# (tests/cuda/test_cuda_megatron.py), the GPU overlap benchmark (recsys_pipe.bench.gpu) and the
# engine benchmark (recsys_pipe.bench.engine); where torchrec imports, also the launcher training
# the torchrec HSTU model on CUDA through the plans (tests/cuda/test_cuda_torchrec.py) and the
# training benchmark against torchrec's pipelines at world size 1 (recsys_pipe.bench.train). Each
# step runs under a time limit and the whole run within --budget seconds (570 by default, so one
# 10-minute remote call always ends with the summary); it prints one summary table.
# Needs a python with CUDA torch, pytest and hypothesis, plus the wheels of what else is imported
# (scripts/gpu_wheels.sh prepares them on a machine with a package index: nvtx for the engine, the
# launcher's config stack and megatron-core for the training steps, torchrec and its dependencies).
#
# Without a package index and with at most 64 MiB per upload, fbgemm-gpu (which torchrec needs)
# comes in pieces, one per run: `--stage 1` and `--stage 2` copy their piece into --stage-dir (a
# folder that outlives the run); `--stage 3` brings the last piece and torchrec's wheels, checks
# every piece against the checksums, joins and unpacks them into a site there, installs the wheels
# of every --wheels folder into it and runs every step. The first run can also run the torch-only
# steps at once (a second, plain call with wheels/small), so something is measured even if the
# machine is lost before the last piece. `--resume` runs again, with that site, the steps a staged
# run left undone (out of time, failed). Logs, the benchmarks' JSON and summary.txt go to --out
# (default: $OUT if set, else runs/gpu_check/<time>). docs/gpu.md has the exact commands.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  cat <<'EOF'
usage: scripts/gpu_check.sh [--out DIR] [--wheels DIR] [--python PY] [--quick] [--budget S]
                            [--stage N [--pieces DIR] [--assemble-only] | --resume] [--stage-dir DIR]
                            [--steps LIST] [--gr DIR]

  --out DIR        where the logs, bench_*.json and summary.txt go
                   (default: $OUT if set, else runs/gpu_check/<time>)
  --wheels DIR     wheels to install without an index; repeatable (default: wheels/small and
                   wheels/torchrec in the repository, those that exist); with --stage, also
                   where fbgemm_gpu.sha256 is looked for
  --python PY      the interpreter with CUDA torch, pytest and hypothesis (default: python3)
  --quick          short benchmark runs: a smoke test of the whole sequence
  --budget S       seconds for this whole run; a step that would not fit is left for --resume
                   (default 570)
  --stage N        the N-th run bringing fbgemm-gpu in pieces: stages piece fb.part0<N-1>; the
                   run that completes the set (fbgemm_gpu.sha256 in --wheels names the pieces)
                   assembles the site and runs every step
  --pieces DIR     where this run's piece is (default: wheels/ in the repository)
  --stage-dir DIR  the folder kept between runs (default: /tmp/recsys_pipe_stage)
  --assemble-only  with --stage: stop once the site is assembled (needs no GPU)
  --resume         run the steps an earlier staged run did not pass, with its assembled site
  --steps LIST     only these steps (comma-separated names, as in the summary; default: all)
  --gr DIR         generative-recommenders' Triton attention for bench_attention (default:
                   wheels/gr where scripts/gpu_wheels.sh --gr put it)
  -h, --help       this text

exit status: 0 every step passed (with --stage: or the piece was staged and more are to come);
             1 a step failed, ran out of time or was left for --resume;
             2 bad arguments, or the engine cannot be imported after installing the wheels;
             3 no CUDA GPU is visible (nothing was run);
             4 the staged pieces are incomplete or corrupt (start again with --stage 1)
EOF
}

bad_usage() {
  echo "gpu_check: $1 (see --help)" >&2
  exit 2
}

OUT_DIR="${OUT:-}"
WHEELS=() # the --wheels folders, in order
PY="python3"
QUICK=0
BUDGET=570
STAGE=0
stage_given=0
PIECES="$ROOT/wheels"
STAGE_DIR="/tmp/recsys_pipe_stage"
ASSEMBLE_ONLY=0
RESUME=0
ONLY_STEPS=""
GR_DIR="$ROOT/wheels/gr"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out | --wheels | --python | --budget | --stage | --pieces | --stage-dir | --steps | --gr)
      [[ $# -ge 2 && -n "$2" ]] || bad_usage "$1 needs a value"
      case "$1" in
        --out) OUT_DIR="$2" ;;
        --wheels) WHEELS+=("$2") ;;
        --python) PY="$2" ;;
        --budget) BUDGET="$2" ;;
        --stage) STAGE="$2" stage_given=1 ;;
        --pieces) PIECES="$2" ;;
        --stage-dir) STAGE_DIR="$2" ;;
        --steps) ONLY_STEPS=",$2," ;;
        --gr) GR_DIR="$2" ;;
      esac
      shift 2
      ;;
    --quick) QUICK=1; shift ;;
    --assemble-only) ASSEMBLE_ONLY=1; shift ;;
    --resume) RESUME=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) bad_usage "unknown argument '$1'" ;;
  esac
done
[[ "$BUDGET" =~ ^[0-9]+$ ]] && ((BUDGET >= 60)) || bad_usage "--budget must be a whole number of seconds >= 60, got '$BUDGET'"
[[ "$STAGE" =~ ^([1-9][0-9]?|0)$ && ("$STAGE" != 0 || "$stage_given" == 0) ]] ||
  bad_usage "--stage must be a piece number from 1 to 99, got '$STAGE'"
if ((STAGE && RESUME)); then
  bad_usage "--stage and --resume exclude each other"
fi
if ((ASSEMBLE_ONLY && !STAGE)); then
  bad_usage "--assemble-only needs --stage"
fi
for dir in ${WHEELS[@]+"${WHEELS[@]}"}; do
  [[ -d "$dir" ]] || bad_usage "--wheels $dir is not a directory"
done
ALL_STEPS=",cuda_tests,launcher_cuda,megatron_cuda,bench_gpu,bench_engine,engine_costs,bench_attention,torchrec_cuda,host_step,bench_hstu_step,bench_train,torch_profile,"
if [[ -n "$ONLY_STEPS" ]]; then
  IFS=',' read -ra wanted_steps <<<"${ONLY_STEPS:1:-1}"
  for name in "${wanted_steps[@]}"; do
    [[ "$ALL_STEPS" == *",$name,"* ]] || bad_usage "--steps: unknown step '$name' (steps: ${ALL_STEPS:1:-1})"
  done
fi
if ((${#WHEELS[@]} == 0)); then # what scripts/gpu_wheels.sh leaves, where a run brought it
  for dir in "$ROOT/wheels/small" "$ROOT/wheels/torchrec"; do
    [[ -d "$dir" ]] && WHEELS+=("$dir")
  done
fi
# every wheel of the --wheels folders
wheel_files() {
  shopt -s nullglob
  local dir file
  for dir in ${WHEELS[@]+"${WHEELS[@]}"}; do
    for file in "$dir"/*.whl; do
      printf '%s\n' "$file"
    done
  done
  shopt -u nullglob
}
command -v "$PY" >/dev/null 2>&1 || bad_usage "python '$PY' not found"

# -- fbgemm-gpu in pieces: stage this run's piece; the run completing the set assembles the site ----
SITE_READY="$STAGE_DIR/site/.recsys_pipe_site_ready"
stage_failed() {
  echo "gpu_check: $1" >&2
  echo "gpu_check: start again with --stage 1 (docs/gpu.md)" >&2
  exit 4
}
if ((STAGE)); then
  piece="$(printf 'fb.part%02d' $((STAGE - 1)))"
  [[ -f "$PIECES/$piece" ]] || bad_usage "--stage $STAGE: no piece $PIECES/$piece here (bring it with this run)"
  if ((STAGE == 1)); then # a new set: nothing of an earlier one may mix in
    rm -rf "$STAGE_DIR"
  fi
  mkdir -p "$STAGE_DIR" || bad_usage "cannot create --stage-dir $STAGE_DIR"
  { cp "$PIECES/$piece" "$STAGE_DIR/$piece.partial" && mv "$STAGE_DIR/$piece.partial" "$STAGE_DIR/$piece"; } ||
    stage_failed "could not copy $piece into $STAGE_DIR"
  echo "[gpu_check] staged $piece in $STAGE_DIR:"
  ls -l "$STAGE_DIR" | sed 's/^/    /'
  manifest=""
  for dir in ${WHEELS[@]+"${WHEELS[@]}"}; do
    if [[ -z "$manifest" && -f "$dir/fbgemm_gpu.sha256" ]]; then
      manifest="$(cd "$dir" && pwd)/fbgemm_gpu.sha256"
    fi
  done
  if [[ -z "$manifest" ]]; then
    echo "[gpu_check] piece $STAGE staged; next: --stage $((STAGE + 1)) with fb.part$(printf '%02d' "$STAGE")"
    exit 0
  fi
  mapfile -t wanted < <(awk '{ print $2 }' "$manifest")
  missing=()
  for name in "${wanted[@]}"; do
    [[ -f "$STAGE_DIR/$name" ]] || missing+=("$name")
  done
  if ((${#missing[@]})); then
    if ((STAGE >= ${#wanted[@]})); then
      stage_failed "pieces missing from $STAGE_DIR: ${missing[*]} (was the machine restarted between runs?)"
    fi
    echo "[gpu_check] piece $STAGE of ${#wanted[@]} staged; next: --stage $((STAGE + 1))"
    exit 0
  fi
  (cd "$STAGE_DIR" && sha256sum --quiet -c "$manifest") >&2 || stage_failed "a piece in $STAGE_DIR does not match $manifest"
  echo "[gpu_check] all ${#wanted[@]} pieces staged and intact: unpacking into $STAGE_DIR/site"
  rm -rf "$STAGE_DIR/site" "$STAGE_DIR/site.partial" "$STAGE_DIR/steps.tsv" "$STAGE_DIR/results"
  start=$SECONDS
  # the pieces joined in order are one tar.xz of the wheel's site-packages layout
  (cd "$STAGE_DIR" && cat "${wanted[@]}") | "$PY" -c '
import sys, tarfile
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz") as archive:
    if hasattr(tarfile, "data_filter"):  # Python >= 3.12 (and patched 3.8+): refuse unsafe members
        archive.extractall(sys.argv[1], filter="data")
    else:
        archive.extractall(sys.argv[1])
' "$STAGE_DIR/site.partial" || stage_failed "the joined pieces did not unpack"
  mapfile -t small < <(wheel_files)
  if ((${#small[@]})); then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --root-user-action=ignore --target "$STAGE_DIR/site.partial" "${small[@]}" >"$STAGE_DIR/pip.log" 2>&1 || {
      echo "gpu_check: the wheels in ${WHEELS[*]} did not install into the staged site:" >&2
      tail -n 20 "$STAGE_DIR/pip.log" >&2
      exit 2
    }
  fi
  mv "$STAGE_DIR/site.partial" "$STAGE_DIR/site"
  touch "$SITE_READY"
  echo "[gpu_check] site assembled in $((SECONDS - start)) s: $(du -sh "$STAGE_DIR/site" | cut -f1), ${#small[@]} wheel(s)"
  if ((ASSEMBLE_ONLY)); then
    exit 0
  fi
elif ((RESUME)) && [[ ! -f "$SITE_READY" ]]; then
  stage_failed "no assembled site in $STAGE_DIR to resume with"
fi
STAGED=0
if ((STAGE || RESUME)); then
  STAGED=1
fi

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
  echo "gpu_check: run this on a GPU machine (docs/gpu.md)." >&2
  exit 3
fi

if [[ -z "$OUT_DIR" ]]; then
  OUT_DIR="$ROOT/runs/gpu_check/$(date +%Y%m%d-%H%M%S)"
fi
mkdir -p "$OUT_DIR" || bad_usage "cannot create --out $OUT_DIR"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# -- the wheels brought along, into a temporary site (or the staged one) -----------------------------
if ((STAGED)); then
  SITE="$STAGE_DIR/site"
else
  SITE="$WORK/site"
  mkdir -p "$SITE"
  mapfile -t wheels < <(wheel_files)
  if ((${#wheels[@]})); then
    echo "[gpu_check] installing ${#wheels[@]} wheel(s) from ${WHEELS[*]} into a temporary site"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --root-user-action=ignore --target "$SITE" "${wheels[@]}" >"$WORK/pip.log" 2>&1; then
      echo "gpu_check: the wheels in ${WHEELS[*]} did not install:" >&2
      tail -n 20 "$WORK/pip.log" >&2
      exit 2
    fi
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
# A staged run keeps its step table and results in --stage-dir, so --resume can skip what passed.
if ((STAGED)); then
  STEPS="$STAGE_DIR/steps.tsv"
  RESULTS="$STAGE_DIR/results"
  mkdir -p "$RESULTS"
  cp -r "$RESULTS"/. "$OUT_DIR"/ # earlier runs' logs and reports, for the summary
else
  STEPS="$WORK/steps.tsv"
  RESULTS=""
fi
touch "$STEPS"
#: seconds kept for the summary at the end of --budget; a step gets at least MIN_STEP_S or waits
SUMMARY_RESERVE_S=15
MIN_STEP_S=30

# record NAME STATUS SECONDS: the step's row in $STEPS (replacing an earlier run's)
record() {
  awk -F'\t' -v name="$1" '$1 != name' "$STEPS" >"$STEPS.new" && mv "$STEPS.new" "$STEPS"
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$STEPS"
}

# selected NAME: whether --steps (or its absence) chose step NAME
selected() {
  [[ -z "$ONLY_STEPS" || "$ONLY_STEPS" == *",$1,"* ]]
}

# run_step NAME LIMIT_S COMMAND...: runs COMMAND in the repository root under a time limit (cut to
# what is left of --budget), output to $OUT_DIR/NAME.log; records "NAME<TAB>status<TAB>seconds". On
# --resume a step that passed before is not run again.
run_step() {
  local name="$1" limit="$2"
  shift 2
  selected "$name" || return 0
  if ((RESUME)) && awk -F'\t' -v name="$name" '$1 == name && $2 == "passed" { found = 1 } END { exit !found }' "$STEPS"; then
    echo "[gpu_check] $name: passed in an earlier run"
    return
  fi
  local left=$((BUDGET - SUMMARY_RESERVE_S - SECONDS))
  if ((left < MIN_STEP_S)); then
    record "$name" "left for --resume" 0
    echo "[gpu_check] $name: not started, ${left} s of --budget left (run again with --resume)"
    return
  fi
  ((limit <= left)) || limit=$left
  local log="$OUT_DIR/$name.log" start=$SECONDS rc status
  echo "[gpu_check] $name: running (limit ${limit} s)"
  (cd "$ROOT" && timeout --kill-after=15 "$limit" "$@") >"$log" 2>&1
  rc=$?
  case $rc in
    0) status="passed" ;;
    124 | 137) status="timed out after ${limit} s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  record "$name" "$status" "$((SECONDS - start))"
  echo "[gpu_check] $name: $status in $((SECONDS - start)) s (log: $log)"
  if [[ $rc -ne 0 ]]; then
    tail -n 30 "$log" | sed 's/^/    /'
  fi
  keep "$name.log"
}

# keep FILE: a report in $OUT_DIR, also kept in the stage folder (for a later --resume's summary)
keep() {
  if [[ -n "$RESULTS" && -f "$OUT_DIR/$1" ]]; then
    cp "$OUT_DIR/$1" "$RESULTS/"
  fi
}

# last_json NAME: the benchmark's last output line (its JSON report), if it is one
last_json() {
  local log="$OUT_DIR/$1.log" json="$OUT_DIR/$1.json"
  [[ -f "$log" ]] || return 0
  tail -n 1 "$log" | grep '^{' >"$json" || rm -f "$json"
  keep "$1.json"
}

bench_args=()
if ((QUICK)); then
  bench_args=(--quick)
fi

TRAINING_TESTS=(tests/cuda/test_cuda_launcher.py tests/cuda/test_cuda_megatron.py tests/cuda/test_cuda_torchrec.py)
HOST_TEST=tests/cuda/test_cuda_host_sync.py # needs torchrec: run by host_step
RAW_IDS_TEST=tests/cuda/test_cuda_raw_ids.py # needs torchrec: run by torchrec_cuda
run_step cuda_tests 180 "$PY" -m pytest tests/cuda -q -rs -p no:cacheprovider \
  "${TRAINING_TESTS[@]/#/--ignore=}" "--ignore=$HOST_TEST" "--ignore=$RAW_IDS_TEST"
run_step launcher_cuda 120 "$PY" -m pytest "${TRAINING_TESTS[0]}" -q -rs -p no:cacheprovider
run_step megatron_cuda 60 "$PY" -m pytest "${TRAINING_TESTS[1]}" -q -rs -p no:cacheprovider
run_step bench_gpu 120 "$PY" -m recsys_pipe.bench.gpu ${bench_args[@]+"${bench_args[@]}"}
last_json bench_gpu

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
run_step bench_engine 90 "$PY" -m recsys_pipe.bench.engine ${engine_args[@]+"${engine_args[@]}"}
last_json bench_engine
# the engine's per-task CUDA cost, split: stream entry, event record and wait, thread hand-offs
run_step engine_costs 60 "$PY" -m recsys_pipe.bench.engine_costs ${bench_args[@]+"${bench_args[@]}"}
last_json engine_costs
# the HSTU attention alone, padded against the Triton kernels (and generative-recommenders' where
# its files were brought: scripts/gpu_wheels.sh --gr): torch and triton only
attention_args=(--only attention --shapes e2e_1024,e2e,dlrmv4)
if ((QUICK)); then
  attention_args=(--only attention --quick)
fi
attention_path="$PYTHONPATH"
if [[ -d "$GR_DIR/generative_recommenders" ]]; then
  attention_args+=(--gr)
  attention_path="$(cd "$GR_DIR" && pwd):$PYTHONPATH"
fi
run_step bench_attention 240 env PYTHONPATH="$attention_path" "$PY" -m recsys_pipe.bench.hstu_gpu "${attention_args[@]}"
last_json bench_attention

# torchrec's steps, where torchrec and its CUDA fbgemm-gpu import (brought by the --stage runs)
TORCHREC_NOTE=""
if torchrec_error="$("$PY" -c 'import fbgemm_gpu, torchrec' 2>&1)"; then
  run_step torchrec_cuda 300 "$PY" -m pytest "${TRAINING_TESTS[2]}" "$RAW_IDS_TEST" -q -rs -p no:cacheprovider
  # the host side of the benchmark's HSTU step at batch 1024 (one GPU: world size 1): the dense step
  # under CUDA's sync detection, then CPU ms against GPU ms per step with the operators, kernel
  # launches and host syncs of each task (recsys-bench train --host)
  if ((QUICK)); then
    host_args=(--quick --host)
  else
    host_args=(--host --batch-sizes 1024 --repeats 3 --variants serial,sparse_dist,hstu_prefetch/threaded)
  fi
  run_step host_step 180 bash -c '"$0" -m pytest "$1" -q -rs -p no:cacheprovider && py="$0" && shift &&
    "$py" -m torch.distributed.run --standalone --nproc_per_node 1 -m recsys_pipe.bench.train "$@"' \
    "$PY" "$HOST_TEST" "${host_args[@]}"
  last_json host_step
  # the HSTU step at production sizes and the benchmark's small model: MFU, CPU and GPU ms per
  # step, padded against triton attention
  step_args=(--only step --shapes e2e,dlrmv4,small_256,small_1024)
  if ((QUICK)); then
    step_args=(--only step --quick)
  fi
  run_step bench_hstu_step 240 "$PY" -m recsys_pipe.bench.hstu_gpu "${step_args[@]}"
  last_json bench_hstu_step
  if ((QUICK)); then
    train_args=(--quick)
  else
    train_args=(--batch-sizes 256 --repeats 3)
  fi
  # one GPU: world size 1 (NCCL refuses two ranks on one device)
  run_step bench_train 240 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 \
    -m recsys_pipe.bench.train "${train_args[@]}"
  last_json bench_train
  # where a step's GPU time goes: torch's operator table of two steps of the HSTU model (batch 1024)
  run_step torch_profile 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 \
    -m recsys_pipe.cli.train pipeline=serial trainer.device=cuda trainer.backend=nccl \
    data.batch_size=1024 data.num_batches=14 trainer.max_steps=12 trainer.eval_every=0 \
    trainer.progress_bar=false "trainer.torch_profiler.steps=[9,10]" "trainer.output_dir=$WORK/torch_profile"
  cp "$WORK"/torch_profile/recsys-train/*/torch_trace/rank0_ops.txt "$OUT_DIR/torch_profile_ops.txt" 2>/dev/null
  keep torch_profile_ops.txt
elif ((STAGED)); then # the staged site was to bring torchrec: its absence fails the run
  TORCHREC_NOTE="torchrec does not import from the staged site: ${torchrec_error##*$'\n'}"
  for name in torchrec_cuda host_step bench_hstu_step bench_train torch_profile; do
    selected "$name" && record "$name" "failed (no torchrec)" 0
  done
else
  TORCHREC_NOTE="torchrec is not importable here: bring it with the --stage runs (docs/gpu.md)"
fi

# -- one summary --------------------------------------------------------------------------------------
GPU_INFO="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)"
"$PY" - "$OUT_DIR" "$STEPS" "$GPU_INFO" "$PLANS_NOTE" "$TORCHREC_NOTE" <<'PYTHON'
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

out, steps_file, gpu_info = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
plans_note, torchrec_note = sys.argv[4], sys.argv[5]


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
    seq, thr = c["lookahead_sequential"], c["lookahead_threaded"]
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


def bench_train_result():
    r = load("bench_train.json")
    if r is None:
        return "no report"
    parts = []
    for batch_size, entry in r["batches"].items():
        rows = entry["variants"]
        speeds = ", ".join(
            f"{name} {med(row['samples_per_s']):.0f}"
            + (f" (×{med(row['vs_torchrec']):.3f})" if isinstance(row.get("vs_torchrec"), dict) else "")
            for name, row in rows.items()
        )
        parts.append(f"batch {batch_size}: samples/s {speeds}; {entry['losses']['note']}")
    return "; ".join(parts)


def engine_costs_result():
    r = load("engine_costs.json")
    if r is None:
        return "no report"
    text = f"µs per call ({r['streams']}): " + ", ".join(f"{k} {med(v)}" for k, v in r["us_per_call"].items())
    plan = r.get("plan")
    if plan:
        text += "; per task: " + ", ".join(f"{k} {med(v)} µs" for k, v in plan["us_per_task"].items())
    return text


def host_step_result():
    r = load("host_step.json")
    if r is None:
        return "no report"
    parts = []
    for batch_size, entry in r["batches"].items():
        for name, row in entry["variants"].items():
            host = row.get("host")
            if host is None:
                continue
            parts.append(
                f"{name} @ {batch_size}: {med(row['ms_per_step'])} ms/step, CPU {med(row['cpu_ms_per_step'])} vs "
                f"GPU {host.get('gpu_ms_per_step')} ms/step; {host['ops_per_step']:.0f} ops, "
                f"{host['launches_per_step']:.0f} launches, {host['syncs_per_step']} syncs "
                f"({host.get('cuda_sync_warnings_per_step')} by CUDA) per step"
            )
    return "; ".join(parts) or "no host figures"


def hstu_gpu_result(name, part):
    r = load(f"{name}.json")
    if r is None:
        return "no report"
    texts = []
    for shape, entry in r["shapes"].items():
        rows = entry.get(part, {})
        if part == "attention":
            ratios = ", ".join(f"{k} {rows.get(k)}" for k in ("triton_vs_padded", "triton_vs_padded_no_bias", "triton_vs_gr"))
            texts.append(f"{shape}: {ratios}")
        else:
            cells = []
            for variant in ("padded", "triton"):
                row = rows.get(variant, {})
                if "wall_ms" in row:
                    cells.append(
                        f"{variant} {med(row['wall_ms'])} ms (cpu {med(row['cpu_ms'])}, gpu {row['gpu_ms']}), "
                        f"MFU {row['mfu']}"
                    )
                elif row:
                    cells.append(f"{variant} {row.get('error', '?')[:60]}")
            texts.append(f"{shape}: " + "; ".join(cells))
    return " | ".join(texts)


def torch_profile_result():
    path = out / "torch_profile_ops.txt"
    if not path.exists():
        return "no operator table"
    lines = path.read_text().splitlines()
    totals = {}
    for line in lines:  # the footer: "Self CPU time total: 275.649ms", "Self CUDA time total: ..."
        for kind in ("CPU", "CUDA"):
            prefix = f"Self {kind} time total: "
            if line.startswith(prefix):
                value = line[len(prefix):].strip()
                scale = 1e-3 if value.endswith("us") else (1e3 if value.endswith("s") and not value.endswith("ms") else 1)
                totals[kind] = float(value.rstrip("mus")) * scale / 2  # two profiled steps
    per_step = ", ".join(f"{'host' if k == 'CPU' else 'GPU'} {v:.2f} ms/step" for k, v in totals.items())
    header = next((i for i, line in enumerate(lines) if "Self CUDA %" in line), None)
    if header is None:
        return "no CUDA time in the operator table"
    names = [c.strip() for c in lines[header].split("  ") if c.strip()]
    share = names.index("Self CUDA %")
    top = []
    for line in lines[header + 2 :]:
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        if len(cells) != len(names) or len(top) == 3:
            break
        top.append(f"{cells[0][:48]} {cells[share]}")
    return f"batch 1024: {per_step}; self CUDA time, top operators: " + "; ".join(top)


results = {
    "cuda_tests": lambda: tests_result("cuda_tests"),
    "launcher_cuda": lambda: tests_result("launcher_cuda"),
    "megatron_cuda": lambda: tests_result("megatron_cuda"),
    "bench_gpu": bench_gpu_result,
    "bench_engine": bench_engine_result,
    "engine_costs": engine_costs_result,
    "bench_attention": lambda: hstu_gpu_result("bench_attention", "attention"),
    "bench_hstu_step": lambda: hstu_gpu_result("bench_hstu_step", "step"),
    "torchrec_cuda": lambda: tests_result("torchrec_cuda"),
    "host_step": host_step_result,
    "bench_train": bench_train_result,
    "torch_profile": torch_profile_result,
}
rows = [line.split("\t") for line in steps_file.read_text().splitlines()]
header = (
    f"gpu_check on {gpu_info or (torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no visible GPU')}; torch {torch.__version__} (CUDA {torch.version.cuda}), "
    f"python {platform.python_version()}; {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
)
lines = [header, f"{'step':<14} {'status':<26} {'s':>5}  result"]
for name, status, seconds in rows:
    result = results[name]() if status not in ("left for --resume", "failed (no torchrec)") else "-"
    if status == "failed (no torchrec)":
        result = torchrec_note
    lines.append(f"{name:<14} {status:<26} {seconds:>5}  {result}")
if not any(name == "torchrec_cuda" for name, _, _ in rows):
    lines.append(f"{'torchrec':<14} {'not run':<26} {'-':>5}  {torchrec_note}")
passed = all(status == "passed" for _, status, _ in rows)
left = [name for name, status, _ in rows if status == "left for --resume"]
if left:
    verdict = f"INCOMPLETE: {', '.join(left)} left; run again with --resume"
else:
    verdict = "PASSED" if passed else "FAILED"
lines.append("overall: " + verdict)
text = "\n".join(lines)
(out / "summary.txt").write_text(text + "\n")
print(text)
sys.exit(0 if passed else 1)
PYTHON
status=$?
# the step logs in one archive: summary.txt, the reports and logs.tgz are a handful of files
(cd "$OUT_DIR" && compgen -G '*.log' >/dev/null && tar czf logs.tgz ./*.log && rm -f ./*.log)
exit $status
