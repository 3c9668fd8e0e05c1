#!/usr/bin/env bash
# HSTU on Amazon Games, ours against generative-recommenders' research HSTU, with the reference's
# recipe (its configs/ml-1m/hstu-sampled-softmax-n128-final.gin at the Games length: width 50,
# 2 blocks, 1 head, dropout 0.2, sampled softmax with 128 negatives, temperature 0.05,
# L2-normalised vectors, batch 128, AdamW lr 1e-3 with betas (0.9, 0.98) and no weight decay on
# every weight, the item table included; sequences of the last 50 items padded to 61 positions,
# as the reference pads its data length + 11), on the sequences scripts/reproduce_games.sh uses:
#
#   RECSYS_HSTU_REFERENCE=PATH/generative-recommenders scripts/reproduce_games_hstu.sh PATH/Video.txt [OUT_DIR]
#
# Two cores, one each: the reference (python -m recsys_pipe.bench.hstu_train_reference, one
# thread) on one; ours (recsys-train on one rank, one thread), then ours HSTU-large
# (model=hstu_retrieval_large, the same recipe) on the other. Each evaluates both splits under
# both protocols (100 sampled negatives; the full corpus) every EVAL_EPOCHS epochs, and
# recsys-bench retrieval_report prints all at the epoch with the best validation HR@10.
# Every input is checked first (the data file, both of our runs' configs, the reference clone): a
# bad one exits 2 with one `error: ...` line before anything trains.
# Environment: EPOCHS (the reference's, default 50), OURS_EPOCHS (default 30), LARGE_EPOCHS (default
# 20; 0 skips HSTU-large), EVAL_EPOCHS
# (default 5): sized to fit 60 minutes on a 2-core machine (docs/reproducing.md); EXTRA (more
# Hydra overrides for our runs).
set -euo pipefail
DATA="${1:?usage: scripts/reproduce_games_hstu.sh PATH/Video.txt [OUT_DIR]}"
OUT="${2:-runs/reproduce_games_hstu}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$ROOT/.venv/bin:$PATH"
export OMP_NUM_THREADS=1
: "${RECSYS_HSTU_REFERENCE:?set RECSYS_HSTU_REFERENCE to a clone of github.com/meta-recsys/generative-recommenders}"
EPOCHS="${EPOCHS:-50}"
EVAL_EPOCHS="${EVAL_EPOCHS:-5}"
OURS_EPOCHS="${OURS_EPOCHS:-30}"
LARGE_EPOCHS="${LARGE_EPOCHS:-20}"
RECIPE=(model.max_seq_len=61 data.max_seq_len=50 model.compute_kernel=dense optimizer.lr=0.001 "optimizer.betas=[0.9,0.98]")

run_args() {  # name, epochs, then overrides: the run's recsys-train arguments, in ARGS
  local name="$1" epochs="$2"; shift 2
  # shellcheck disable=SC2206  # EXTRA is a list of overrides
  ARGS=(data=sequences "data.path=$DATA" data.batch_size=128 data.eval_batch_size=512 pipeline=prefetch
    model.sharding=row_wise "${RECIPE[@]}" trainer.max_steps=null "trainer.epochs=$epochs"
    trainer.eval_every=1000000000 "trainer.eval_epochs=$EVAL_EPOCHS" trainer.log_every=100 trainer.progress_bar=false
    "hydra.run.dir=$OUT/$name" trainer.eval_dump=eval_dump.csv "$@" ${EXTRA:-})
}

check() {  # as ours' arguments: every check the run makes, one `error:` line per problem
  local status=0 err
  run_args "$@"
  err=$(recsys-train --check "${ARGS[@]}" 2>&1 >/dev/null) || status=$?
  if [ "$status" -ne 0 ]; then
    grep '^error: ' <<<"$err" >&2 || printf '%s\n' "$err" >&2
    exit "$status"
  fi
}

ours() {  # name, epochs, then overrides
  local name="$1" start
  run_args "$@"
  start=$(date +%s)
  recsys-train "${ARGS[@]}" > "$OUT/$name.out" 2>&1
  echo "$(($(date +%s) - start))" > "$OUT/$name/train_seconds"
}

reference() {
  local start
  start=$(date +%s)
  python -m recsys_pipe.bench.hstu_train_reference --data "$DATA" --out "$OUT/hstu_reference" \
    --epochs "$EPOCHS" --eval-epochs "$EVAL_EPOCHS" > "$OUT/hstu_reference.out" 2>&1
  echo "$(($(date +%s) - start))" > "$OUT/hstu_reference/train_seconds"
}

if [ ! -f "$RECSYS_HSTU_REFERENCE/generative_recommenders/research/modeling/sequential/hstu.py" ]; then
  echo "error: RECSYS_HSTU_REFERENCE: $RECSYS_HSTU_REFERENCE is not a clone of generative-recommenders" >&2
  exit 2
fi
check hstu "$OURS_EPOCHS" model=hstu_retrieval
if [ "$LARGE_EPOCHS" -gt 0 ]; then
  check hstu_large "$LARGE_EPOCHS" model=hstu_retrieval_large
fi
mkdir -p "$OUT"

reference &
(
  ours hstu "$OURS_EPOCHS" model=hstu_retrieval
  if [ "$LARGE_EPOCHS" -gt 0 ]; then
    ours hstu_large "$LARGE_EPOCHS" model=hstu_retrieval_large
  fi
) &
wait
python -m recsys_pipe.bench.retrieval_report "$OUT"
