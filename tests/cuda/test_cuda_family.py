"""torchrec's TrainPipelineSemiSync and TrainPipelineFusedSparseDist against the semi_sync and
fused_sparse_dist plans, on CUDA.

Both classes fail on the CPU in torchrec 1.8: they record the batch (SemiSync, in
`_wait_for_events`) or the input KJT (Fused, in `_start_embedding_lookup`) on the CPU's
"current stream", and `Tensor.record_stream` rejects it: `RuntimeError: unknown parameter type`.
So they are compared here, on a GPU, with the plans (same batches and seeds, per-step losses,
sample ids and every final local parameter), and the CPU reference loop of semi_sync
(`run_stale_embedding_reference`) is checked against torchrec's SemiSync too.

Tolerance: bitwise, under `torch.use_deterministic_algorithms(True)`: the plans run torchrec's
own lookup, forward and backward steps in torchrec's order.
"""

import pytest
from _launcher_runs import require_packages

from recsys_pipe.testing import check_torchrun, read_rank_results, run_torchrun

pytestmark = pytest.mark.timeout(500)
CPU_COUNTERPART = (
    "tests/integration/test_train_parity.py::test_semi_sync_plan_matches_a_loop_with_one_step_stale_embeddings_bitwise "
    "::test_semi_sync_warm_up_matches_its_reference_loop_bitwise and "
    "::test_each_family_plan_matches_its_torchrec_class_bitwise (fused_sparse_dist, in-place copy) check the plans "
    "on CPU"
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch

    require_packages("torchrec", "fbgemm_gpu")
    out = tmp_path_factory.mktemp("family_cuda")
    nproc = min(2, torch.cuda.device_count())
    worker = __file__.replace("cuda/test_cuda_family.py", "dist/family_cuda_worker.py")
    proc = run_torchrun(worker, str(out), nproc=nproc, timeout=450)
    check_torchrun(proc)
    return read_rank_results(out, nproc)


def _same(a, b, what):
    assert a["losses"] == b["losses"], f"{what}: losses"
    assert a["sample_ids"] == b["sample_ids"], f"{what}: batches"
    assert a["params"] == b["params"], f"{what}: final parameters"


def test_semi_sync_plan_matches_torchrecs_semi_sync_class(ranks):
    for data in ranks:
        v = data["variants"]
        _same(v["semi_sync"], v["torchrec_TrainPipelineSemiSync"], "semi_sync vs TrainPipelineSemiSync")
        _same(v["stale_reference"], v["torchrec_TrainPipelineSemiSync"], "reference loop vs TrainPipelineSemiSync")
        assert v["semi_sync"]["losses"] != v["serial"]["losses"]  # really stale


def test_semi_sync_warm_up_and_stash_match_torchrecs_semi_sync_class(ranks):
    """start_batch=5 (the plan's lookup options) and stash_gradients against torchrec's own."""
    for data in ranks:
        v = data["variants"]
        _same(v["semi_sync/start_batch=5"], v["torchrec_TrainPipelineSemiSync/start_batch=5"], "start_batch=5")
        _same(
            v["semi_sync_stash/start_batch=5"],
            v["torchrec_TrainPipelineSemiSync/start_batch=5/stash"],
            "start_batch=5, stash_gradients",
        )
        assert v["semi_sync/start_batch=5"]["losses"][:6] == v["serial"]["losses"][:6]  # synchronous warm-up


def test_inplace_copy_matches_torchrecs_inplace_copy(ranks):
    """h2d's options.inplace_copy (allocated on the default stream, copied on memcpy) against
    TrainPipelineSparseDist(enable_inplace_copy_batch=True), and against serial."""
    for data in ranks:
        v = data["variants"]
        _same(v["sparse_dist/inplace_copy"], v["torchrec_TrainPipelineSparseDist/inplace_copy"], "inplace copy")
        _same(v["sparse_dist/inplace_copy"], v["serial"], "inplace copy vs serial")


def test_fused_sparse_dist_plan_matches_torchrecs_fused_class(ranks):
    for data in ranks:
        v = data["variants"]
        _same(v["fused_sparse_dist"], v["torchrec_TrainPipelineFusedSparseDist"], "fused_sparse_dist vs torchrec")
        _same(v["fused_sparse_dist"], v["serial"], "fused_sparse_dist vs serial")
