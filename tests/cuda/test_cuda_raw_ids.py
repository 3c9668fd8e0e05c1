"""Managed-collision tables (`ids: managed`, docs/raw-ids.md) trained on CUDA through the plans,
at world size 1: torchrec's sharded managed-collision modules with their CUDA eviction (fbgemm's
reset of an evicted row's row-wise Adagrad state runs on the GPU; the project's sharders do it
themselves on the CPU only). DLRM's pooled tables and HSTU's item and user tables, evicting every
2 steps, one run per plan through the launcher (tests/dist/launcher_worker.py).

Tolerance: bitwise, with `torch.use_deterministic_algorithms(True)` (tests/_launcher_runs.py).
Needs torchrec and the CUDA fbgemm-gpu (brought by `scripts/gpu_check.sh --stage`).
"""

import pytest
from _launcher_runs import LAUNCHER_PACKAGES, assert_runs_match_serial, require_packages, run_launcher_worker

pytestmark = pytest.mark.timeout(600)
CPU_COUNTERPART = (
    "tests/integration/test_raw_ids.py trains managed tables through every plan at 1 and 2 ranks on the CPU"
)

STEPS = 12
VARIANTS = ["serial", "sparse_dist", "hstu_sparse_dist", "hstu_prefetch", "hstu_prefetch/per_task"]


@pytest.mark.parametrize("model", ["dlrm_managed", "hstu_managed"])
def test_every_plan_trains_the_serial_losses_with_managed_tables_on_cuda(model, tmp_path):
    require_packages(*LAUNCHER_PACKAGES, "torchrec", "fbgemm_gpu")
    report = run_launcher_worker(tmp_path, "cuda", VARIANTS, STEPS, timeout=500, model=model, block_torchrec=False)
    assert list(report["variants"]) == VARIANTS
    assert_runs_match_serial(report, STEPS, placement="1 rank(s) on cuda:0 (nccl)", torchrec=True)
