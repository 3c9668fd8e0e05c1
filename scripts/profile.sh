#!/usr/bin/env bash
# Profiles the main job: installs the environment if needed, then measures where the time of a
# training step goes for HSTU with the prefetch plan on 2 ranks (per-task costs, exposed times,
# trace, timeline; files in runs/recsys-profile/<time>/). Extra args are Hydra overrides, e.g.
# scripts/profile.sh pipeline=serial profile.iters=30. NPROC=1 for a single rank.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
export PATH="$ROOT/.venv/bin:$PATH"
# One intra-op thread per rank: ranks already use every core of a small machine.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --standalone --nproc_per_node "${NPROC:-2}" --no-python \
  recsys-profile pipeline=hstu_prefetch "$@"
