"""`recsys-train` trains a model with plain torch tables on CUDA, without torchrec.

`model=dlrm_torch` (its tables are `nn.Embedding`s under DDP) through the launcher, one run per
plan: serial, sparse_dist (pipelined, sequential executor), hstu_sparse_dist (threaded, io and
compute threads), hstu_prefetch (threaded, prefetch context, four streams; also one thread per
task), and `trainer.dense_ddp=megatron` with the serial and hstu_prefetch plans. Pinned host
batches copied on the memcpy stream, recorded for the other streams (the training h2d task), NCCL
on one GPU, `torch.use_deterministic_algorithms(True)`, torchrec made unimportable.

Tolerance: bitwise; why, in tests/_launcher_runs.py. The CPU counterpart (same worker) is
tests/integration/test_torch_only.py::test_launcher_plans_train_the_same_losses_without_torchrec.
"""

import pytest
from _launcher_runs import LAUNCHER_PACKAGES, assert_runs_match_serial, require_packages, run_launcher_worker

pytestmark = pytest.mark.timeout(400)
CPU_COUNTERPART = (
    "tests/integration/test_torch_only.py::test_launcher_plans_train_the_same_losses_without_torchrec "
    "runs the same worker on CPU"
)

STEPS = 16
VARIANTS = [
    "serial",
    "sparse_dist",
    "hstu_sparse_dist",
    "hstu_prefetch",
    "hstu_prefetch/per_task",
    "megatron/serial",
    "megatron/hstu_prefetch",
]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    require_packages(*LAUNCHER_PACKAGES, "megatron.core")
    return run_launcher_worker(tmp_path_factory.mktemp("launcher"), "cuda", VARIANTS, STEPS, timeout=360)


def test_every_plan_and_megatron_ddp_train_the_serial_losses_on_cuda(report):
    assert list(report["variants"]) == VARIANTS
    assert_runs_match_serial(report, STEPS, placement="1 rank(s) on cuda:0 (nccl)")
