"""`recsys-train` trains the torchrec HSTU model through the plans at world size 1, on CPU: the
worker that tests/cuda/test_cuda_torchrec.py runs on a GPU, here with gloo (the 2-rank torchrec
parity of every plan is tests/integration/test_train_parity.py).

Tolerance: bitwise (why, in tests/_launcher_runs.py)."""

import pytest
from _launcher_runs import assert_runs_match_serial, run_launcher_worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

VARIANTS = ["serial", "sparse_dist", "hstu_sparse_dist", "hstu_prefetch", "hstu_prefetch/per_task"]


def test_launcher_plans_train_the_same_losses_with_torchrec_tables(tmp_path):
    report = run_launcher_worker(
        tmp_path, "cpu", VARIANTS, steps=8, timeout=360, model="hstu_small", block_torchrec=False
    )
    assert list(report["variants"]) == VARIANTS
    assert_runs_match_serial(report, 8, placement="1 rank(s) on cpu (gloo)", torchrec=True)
