"""`recsys-train` trains the torchrec HSTU model on CUDA through the plans, at world size 1.

`model=hstu_small` (torchrec `EmbeddingCollection` tables sharded by DMP, fbgemm's fused CUDA
kernels, the optimizer fused into the backward) through the launcher, one run per plan: serial,
sparse_dist (torchrec's input-dist split off the forward, sequential executor), hstu_sparse_dist
(threaded), hstu_prefetch (the prefetch context, four streams; also one thread per task). NCCL on
one GPU: the input all-to-alls are local, so the plans with lookaheads move the copies, the input
distribution and the prefetch to other streams and threads and change no value.

Tolerance: bitwise, with `torch.use_deterministic_algorithms(True)` (why, in tests/_launcher_runs.py);
a difference here is a scheduling bug or a kernel that is not deterministic on this GPU, which the
failure message shows step by step. Needs torchrec and the CUDA fbgemm-gpu (brought by
`scripts/gpu_check.sh --stage`); the CPU counterpart is tests/integration/test_launcher_torchrec.py.
"""

import pytest
from _launcher_runs import LAUNCHER_PACKAGES, assert_runs_match_serial, require_packages, run_launcher_worker

pytestmark = pytest.mark.timeout(400)
CPU_COUNTERPART = (
    "tests/integration/test_launcher_torchrec.py::test_launcher_plans_train_the_same_losses_with_torchrec_tables "
    "runs the same worker on CPU"
)

STEPS = 16
VARIANTS = ["serial", "sparse_dist", "hstu_sparse_dist", "hstu_prefetch", "hstu_prefetch/per_task"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    require_packages(*LAUNCHER_PACKAGES, "torchrec", "fbgemm_gpu")
    return run_launcher_worker(
        tmp_path_factory.mktemp("launcher"),
        "cuda",
        VARIANTS,
        STEPS,
        timeout=360,
        model="hstu_small",
        block_torchrec=False,
    )


def test_every_plan_trains_the_serial_losses_of_the_torchrec_hstu_model_on_cuda(report):
    assert list(report["variants"]) == VARIANTS
    assert_runs_match_serial(report, STEPS, placement="1 rank(s) on cuda:0 (nccl)", torchrec=True)
