#!/usr/bin/env bash
# Reproduce the SASRec paper's Amazon Games ("Video") row: HR@10 0.7410, NDCG@10 0.5360 under
# leave-one-out with 100 sampled negatives. Download the data set first, e.g. python/data/Video.txt
# of github.com/pmixer/SASRec.pytorch, then:
#
#   scripts/reproduce_games.sh PATH/Video.txt [OUT_DIR]
#
# Trains SASRec with the paper's hyper-parameters (width 50, 2 blocks, 1 head, dropout 0.5, max
# length 50, batch 128, Adam lr 1e-3 with betas (0.9, 0.98) on the dense weights, BCE with one
# negative per position), evaluates validation and test after every epoch under the sampled and
# full-corpus protocols, and prints the paper's row, the reference reimplementation's and ours
# (at the epoch with the best validation HR@10), the training time and an HR@10-vs-epoch plot.
# The item table is trained by fbgemm's fused row-wise Adagrad (fbgemm has no fused Adam on CPU).
# Environment: EPOCHS (default 200), NPROC ranks (default 1), HSTU=1 also trains hstu_retrieval,
# OMP_NUM_THREADS (default 1), EXTRA (more Hydra overrides for every run).
set -euo pipefail
DATA="${1:?usage: scripts/reproduce_games.sh PATH/Video.txt [OUT_DIR]}"
OUT="${2:-runs/reproduce_games}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$ROOT/.venv/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
EPOCHS="${EPOCHS:-200}"
NPROC="${NPROC:-1}"
mkdir -p "$OUT"

launch() {
  if [ "$NPROC" -gt 1 ]; then
    torchrun --standalone --nproc_per_node "$NPROC" --no-python recsys-train "$@"
  else
    recsys-train "$@"
  fi
}

train() {  # name, then overrides
  local name="$1"; shift
  local start end
  start=$(date +%s)
  # shellcheck disable=SC2086  # EXTRA is a list of overrides
  launch data=sequences "data.path=$DATA" pipeline=hstu_prefetch \
    "optimizer.betas=[0.9,0.98]" optimizer.sparse.name=rowwise_adagrad optimizer.sparse.lr=0.05 \
    trainer.max_steps=null "trainer.epochs=$EPOCHS" trainer.eval_every=1000000000 trainer.log_every=100 \
    trainer.progress_bar=false "hydra.run.dir=$OUT/$name" "trainer.eval_dump=$OUT/$name/eval_dump.csv" \
    "$@" ${EXTRA:-}
  end=$(date +%s)
  echo "$((end - start))" > "$OUT/$name/train_seconds"
}

train sasrec model=sasrec
if [ "${HSTU:-0}" = 1 ]; then
  train hstu model=hstu_retrieval
fi
python "$ROOT/scripts/retrieval_report.py" "$OUT"
