#!/usr/bin/env bash
# The main job: installs the environment if needed, then trains HSTU on synthetic data with
# the prefetch plan on 2 ranks (gloo on CPU, NCCL on CUDA). Extra args are Hydra overrides,
# e.g. scripts/train.sh pipeline=serial trainer.max_steps=50. NPROC=1 for a single rank.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
export PATH="$ROOT/.venv/bin:$PATH"
# One intra-op thread per rank: ranks already use every core of a small machine.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --standalone --nproc_per_node "${NPROC:-2}" --no-python \
  recsys-train pipeline=hstu_prefetch "$@"
