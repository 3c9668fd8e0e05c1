"""The HSTU model's dense step on a GPU never makes the host wait for the device: forward,
backward and the fused Adam step of `HSTURanker`, with the padded and with the Triton attention,
in float32 and under bfloat16 autocast, run under `torch.cuda.set_sync_debug_mode("error")`,
which raises at any synchronizing CUDA call (a read of a device value, a blocking copy, an
operator sized by device data). A warm-up step first (the Triton kernels autotune then, which
synchronizes on purpose). Needs torchrec and fbgemm-gpu (the model's inputs are torchrec's jagged
tensors): the GPU check runs it in its `host_step` step, with the staged site.
"""

from __future__ import annotations

import os

import pytest
import torch

CPU_COUNTERPART = "tests/unit/test_hstu_host_sync.py checks the padded attention's step with fake tensors on CPU"

os.environ.setdefault("RECSYS_HSTU_TRITON_AUTOTUNE", "0")  # one config per kernel: no benchmarking runs

B, WIDTH = 64, 32


def _step(attention: str, bf16: bool):
    pytest.importorskip("torchrec", reason="the HSTU model's inputs are torchrec's jagged tensors")
    pytest.importorskip("fbgemm_gpu", reason="the HSTU model needs fbgemm-gpu")
    if attention == "triton":
        pytest.importorskip("triton", reason="the Triton attention needs the triton package")
    from torchrec.sparse.jagged_tensor import JaggedTensor

    from recsys_pipe.data.batch import ACTION_KEY, ITEM_KEY, DataSpec
    from recsys_pipe.models.hstu import HSTUConfig, HSTURanker

    torch.manual_seed(0)
    cfg = HSTUConfig(attention=attention, num_time_buckets=32)
    ranker = HSTURanker(cfg, DataSpec(num_tasks=2, vocab_sizes={ITEM_KEY: 100, ACTION_KEY: 5})).cuda()
    optimizer = torch.optim.Adam(ranker.parameters(), lr=1e-3, fused=True)
    lengths = torch.randint(3, cfg.max_seq_len + 1, (B,), device="cuda", dtype=torch.int32)
    tokens = int(lengths.sum())  # before the checked window: a batch arrives with its shapes known
    candidates = torch.full((B,), 2, device="cuda", dtype=torch.int64)
    labels = torch.rand(2 * B, 2, device="cuda")
    timestamps = torch.randint(0, 86_400, (tokens,), device="cuda").cumsum(0)

    def step() -> torch.Tensor:
        embeddings = {
            key: JaggedTensor(values=torch.randn(tokens, WIDTH, device="cuda", requires_grad=True), lengths=lengths)
            for key in (ITEM_KEY, ACTION_KEY)
        }
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = ranker(embeddings, timestamps, candidates, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["padded", "triton"])
def test_the_dense_hstu_step_never_waits_for_the_gpu(attention, bf16):
    step = _step(attention, bf16)
    step()  # warm-up: autotuning, the bucket bounds, the optimizer's state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [step() for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(bool(torch.isfinite(loss)) for loss in losses)


def test_the_check_can_fail():
    """Not vacuous: a read of a device value in the window raises."""
    x = torch.ones(4, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            x.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode("default")
