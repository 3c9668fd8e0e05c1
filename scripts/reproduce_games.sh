#!/usr/bin/env bash
# Reproduce the SASRec paper's Amazon Games ("Video") row: HR@10 0.7410, NDCG@10 0.5360 under
# leave-one-out with 100 sampled negatives. Download the data set first, e.g. python/data/Video.txt
# of github.com/pmixer/SASRec.pytorch, then:
#
#   scripts/reproduce_games.sh PATH/Video.txt [OUT_DIR]
#
# Trains SASRec with the paper's hyper-parameters (width 50, 2 blocks, 1 head, dropout 0.5, max
# length 50, batch 128 = 64 per rank on 2 ranks, Adam lr 1e-3 with betas (0.9, 0.98), BCE with
# one negative per position) in pre-LN blocks (the reference reimplementation's `norm_first`), then HSTU (sampled softmax, 128 negatives shared by the batch, temperature 0.05) on the same data;
# evaluates validation and test every EVAL_EPOCHS epochs under the sampled and full-corpus protocols,
# and prints the paper's row, the reference reimplementation's and ours (at the epoch with the
# best validation HR@10), the training times and an HR@10-vs-epoch plot.
# SASRec's item table is on torchrec's dense kernel, so Adam updates it with the encoder, as in the
# paper's code; HSTU's is updated by fbgemm's fused row-wise Adagrad (lr 0.05), which trains it
# better here than Adam (measured: docs/reproducing.md).
# Both runs' configs and inputs (the data file, the run directories) are checked first, as
# scripts/train.sh does: a bad one exits 2 with one `error: <key>: ...` line, before anything trains.
# Environment: SASREC_EPOCHS (default 150), HSTU_EPOCHS (default 60; 0 skips HSTU), EVAL_EPOCHS
# (default 5), NPROC ranks (default 2), OMP_NUM_THREADS (default 1), EXTRA (more Hydra overrides
# for every run).
set -euo pipefail
DATA="${1:?usage: scripts/reproduce_games.sh PATH/Video.txt [OUT_DIR]}"
OUT="${2:-runs/reproduce_games}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$ROOT/.venv/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
SASREC_EPOCHS="${SASREC_EPOCHS:-150}"
HSTU_EPOCHS="${HSTU_EPOCHS:-60}"
EVAL_EPOCHS="${EVAL_EPOCHS:-5}"
NPROC="${NPROC:-2}"
BATCH=$((128 / NPROC))  # the paper's batch of 128 users, split over the ranks

launch() {
  if [ "$NPROC" -gt 1 ]; then
    torchrun --standalone --nproc_per_node "$NPROC" --no-python recsys-train "$@"
  else
    recsys-train "$@"
  fi
}

run_args() {  # name, epochs, then overrides: the run's recsys-train arguments, in ARGS
  local name="$1" epochs="$2"; shift 2
  # shellcheck disable=SC2206  # EXTRA is a list of overrides
  ARGS=(data=sequences "data.path=$DATA" "data.batch_size=$BATCH" data.eval_batch_size=512 pipeline=prefetch model.sharding=row_wise
    "optimizer.betas=[0.9,0.98]"
    trainer.max_steps=null "trainer.epochs=$epochs" trainer.eval_every=1000000000 "trainer.eval_epochs=$EVAL_EPOCHS" trainer.log_every=100
    trainer.progress_bar=false "hydra.run.dir=$OUT/$name" trainer.eval_dump=eval_dump.csv
    "$@" ${EXTRA:-})
}

check() {  # as train's arguments: every check a rank makes (the last rank's share), one line per problem
  local status=0 err
  run_args "$@"
  err=$(WORLD_SIZE="$NPROC" RANK="$((NPROC - 1))" recsys-train --check "${ARGS[@]}" 2>&1 >/dev/null) || status=$?
  if [ "$status" -ne 0 ]; then
    grep '^error: ' <<<"$err" >&2 || printf '%s\n' "$err" >&2
    exit "$status"
  fi
}

train() {  # name, epochs, then overrides
  local name="$1" start end
  run_args "$@"
  start=$(date +%s)
  launch "${ARGS[@]}"
  end=$(date +%s)
  echo "$((end - start))" > "$OUT/$name/train_seconds"
}

SASREC=(sasrec "$SASREC_EPOCHS" model=sasrec model.norm_first=true model.compute_kernel=dense)
# HSTU as this script has trained it since 24 November: one pool of negatives per batch (the
# reference's recipe, per-position negatives, is scripts/reproduce_games_hstu.sh's)
HSTU=(hstu "$HSTU_EPOCHS" model=hstu_retrieval model.negatives=shared optimizer.sparse.name=rowwise_adagrad
  optimizer.sparse.lr=0.05)
check "${SASREC[@]}"
if [ "$HSTU_EPOCHS" -gt 0 ]; then
  check "${HSTU[@]}"
fi
mkdir -p "$OUT"
train "${SASREC[@]}"
if [ "$HSTU_EPOCHS" -gt 0 ]; then
  train "${HSTU[@]}"
fi
python -m recsys_pipe.bench.retrieval_report "$OUT"
