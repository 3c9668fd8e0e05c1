"""`trainer.dense_ddp=megatron` on a GPU: megatron-core's DistributedDataParallel (parallel_state
with tensor- and pipeline-parallel size 1) against torch DDP, world size 1, NCCL.

`model=dlrm_torch` built by `build_model` from the same weights, trained on the same batches
through the serial plan and the threaded hstu_prefetch plan, with
`torch.use_deterministic_algorithms(True)`: after every optimizer step the loss, every gradient
and every parameter must equal torch DDP's. Also checked: the gradient buffers live on the GPU,
each `.grad` is a view of them after finalize_model_grads (no copy), parallel_state is
initialized while the model lives and destroyed when it is closed.

Tolerance: bitwise; why, in tests/_dense_ddp.py. The CPU counterparts (same worker, one and two
ranks on gloo) are in tests/integration/test_dense_ddp.py.
"""

import pytest
from _dense_ddp import assert_megatron_matches_torch, run_worker
from _launcher_runs import LAUNCHER_PACKAGES, require_packages

pytestmark = pytest.mark.timeout(300)
CPU_COUNTERPART = (
    "tests/integration/test_dense_ddp.py runs the same worker on CPU (megatron-core's buffers redirected to the CPU)"
)


def test_megatron_ddp_trains_like_torch_ddp_bitwise_on_one_gpu(tmp_path):
    require_packages(*LAUNCHER_PACKAGES, "megatron.core")
    assert_megatron_matches_torch(run_worker(tmp_path, "cuda", timeout=240), "cuda")
