#!/usr/bin/env bash
# The main job: installs the environment if needed, then trains HSTU on synthetic data with the
# default plan (hstu_prefetch) on 2 ranks (gloo on CPU, NCCL on CUDA). Extra args are Hydra
# overrides, e.g. scripts/train.sh pipeline=serial trainer.max_steps=50. NPROC=1 for one rank.
#
# The whole config is checked in one process first (`recsys-train --check`: config, plan, data,
# device, output dir, checkpoint), so a bad config prints one line per problem once and exits 2
# without starting torchrun; --help, --cfg and --info never go through torchrun either.
# The ranks run under torchrun's own agent (recsys_pipe.runtime.launcher: torchrun's arguments),
# which passes Ctrl-C and SIGTERM on to them and exits with their code. Exit codes: 2 bad config
# or input (found by the check); 0 every rank succeeded; 1 a rank failed (the run's status.json
# and train.log say why); 75 SIGTERM, 130 Ctrl-C: every rank finished its step and the
# checkpoint was saved (resume with trainer.resume_from=latest).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
export PATH="$ROOT/.venv/bin:$PATH"
NPROC="${NPROC:-2}"
for arg in "$@"; do
  case "$arg" in
    -h | --help | --hydra-help | -c | --cfg | --cfg=* | -i | --info | --info=* | --shell-completion | --version)
      exec recsys-train "$@" ;;
  esac
done
# Ctrl-C at any moment ends the script with 130: while the check runs (the check exits 130) and
# between the check and torchrun (this trap; exec hands SIGINT to the launcher, which stops the ranks).
trap 'exit 130' INT
# The last rank's share of the data is checked: the smallest one when the data does not split evenly.
status=0
WORLD_SIZE="$NPROC" RANK="$((NPROC - 1))" recsys-train --check "$@" || status=$?
[[ $status -eq 0 ]] || exit "$status"
# One intra-op thread per rank: ranks already use every core of a small machine.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m recsys_pipe.runtime.launcher --standalone --nproc_per_node "$NPROC" --no-python recsys-train "$@"
