#!/usr/bin/env bash
# The multi-host scenario on one machine (docs/operations/multi-node.md): 8 ranks as 2 hosts x 4
# (two torchrun agents, c10d rendezvous on 127.0.0.1, gloo) train DLRM with every sharding type
# and HSTU ranking at 2 x 2, each against one rank; one run broken 8 -> 4 -> 2 -> 1 ranks across
# sharding types against the run unbroken; the memory estimate against peak RSS at 1-8 ranks and
# the 64-rank dry run. Writes runs/multi_host/multi_host.json and the results section of
# docs/operations/multi-node.md. Extra args go to `recsys-bench multi_host` (e.g. --parts parity).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/recsys-bench" multi_host --out runs/multi_host --docs docs/operations/multi-node.md "$@"
