"""The HSTU model's dense forward and backward never make the host wait for the device: no read of a device
value (`.item()`, `.tolist()`), no operator whose output size depends on the data (`nonzero`,
boolean masks, `repeat_interleave` or fbgemm's `dense_to_jagged` without their sizes), no tensor
made from host data inside the step (a blocking copy to the device on CUDA).

Checked on the CPU with fake tensors (`FakeTensorMode`): they carry shapes, no values, so any of
the first two raises; the operator counter of `recsys-bench train --host` refuses the third.
tests/cuda/test_cuda_host_sync.py checks the same on a GPU with CUDA's own sync detection, for the
Triton attention too (its kernels cannot run on fake tensors).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from recsys_pipe.bench.host_ops import _Counting, _Tally
from recsys_pipe.data.batch import ACTION_KEY, ITEM_KEY, USER_KEY, DataSpec
from recsys_pipe.models.hstu import HSTUConfig, HSTURanker

pytestmark = pytest.mark.timeout(120)

B, WIDTH = 6, 32


def _fake_ranker(cfg: HSTUConfig, spec: DataSpec) -> HSTURanker:
    """The ranker with fake parameters and buffers (made inside the mode)."""
    ranker = HSTURanker(cfg, spec)
    for module in ranker.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(param))
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = torch.empty_like(buffer)
    return ranker


def _inputs(with_user: bool):
    from torchrec.sparse.jagged_tensor import JaggedTensor

    lengths = torch.empty(B, dtype=torch.int32)  # values unknown to the host, as on a device
    tokens = 7 * B  # the jagged token count: a shape, known to the host
    embeddings = {
        key: JaggedTensor(values=torch.empty(tokens, WIDTH, requires_grad=True), lengths=lengths)
        for key in (ITEM_KEY, ACTION_KEY)
    }
    if with_user:
        embeddings[USER_KEY] = JaggedTensor(values=torch.empty(B, WIDTH), lengths=torch.empty(B, dtype=torch.int32))
    timestamps = torch.empty(tokens, dtype=torch.int64)
    num_candidates = torch.empty(B, dtype=torch.int64)
    labels = torch.empty(2 * B, 2)  # candidates: a shape the batch carries
    return embeddings, timestamps, num_candidates, labels


@pytest.mark.parametrize(
    "case",
    ["default", "no_bias", "user_token", "dropout"],
)
def test_the_dense_hstu_step_makes_no_host_sync(case):
    cfg = HSTUConfig(
        attention="padded",
        relative_bias=case != "no_bias",
        dropout=0.2 if case == "dropout" else 0.0,
    )
    vocab = {ITEM_KEY: 100, ACTION_KEY: 5, **({USER_KEY: 10} if case == "user_token" else {})}
    spec = DataSpec(num_tasks=2, vocab_sizes=vocab)
    tally = _Tally()
    with FakeTensorMode(allow_non_fake_inputs=False):
        ranker = _fake_ranker(cfg, spec).train()
        inputs = _inputs(case == "user_token")
        with _Counting(tally, device_run=False):
            loss, aux = ranker(*inputs)
            loss.backward()
    assert loss.shape == () and aux["logits"].shape == (2 * B, 2)
    assert all(p.grad is not None for p in ranker.parameters())
    assert tally.ops and not tally.syncs, dict(tally.syncs)


def test_the_check_catches_a_host_sync():
    """Not vacuous: the model as it was, with `torch.tensor(n, device=...)` in its outputs and
    fbgemm's `dense_to_jagged` left to read the token count, fails both checks."""
    from recsys_pipe.models import hstu

    tally = _Tally()
    with FakeTensorMode(allow_non_fake_inputs=False):
        with _Counting(tally, device_run=False):
            torch.tensor(5, device="cpu")
        offsets = torch.empty(B + 1, dtype=torch.int64)
        dense = torch.empty(B, 4, 3)
        with pytest.raises(torch._subclasses.fake_tensor.DynamicOutputShapeException):
            torch.ops.fbgemm.dense_to_jagged(dense, [offsets])
        with pytest.raises(torch._subclasses.fake_tensor.DataDependentOutputException):
            dense.sum().item()
    assert [kind for kind, _ in tally.syncs] == ["tensor from host data"]
    assert hstu.HSTURanker  # the module under test imported (fbgemm's operators registered)


def test_the_bias_lookup_of_cuda_sums_without_reading_device_values():
    """`SummedBackwardLookup` (the relative bias's lookup on CUDA, where the CPU's indexing is not
    used) through backward on fake tensors: its per-entry counts come from a binary search, not
    `torch.bincount` (sized by the largest index: a host sync on CUDA)."""
    from recsys_pipe.models.hstu_attention import SummedBackwardLookup

    tally = _Tally()
    with FakeTensorMode(allow_non_fake_inputs=False):
        table = torch.empty(33, requires_grad=True)
        index = torch.empty(B, 16, 16, dtype=torch.int64)
        with _Counting(tally, device_run=False):
            SummedBackwardLookup.apply(table, index).sum().backward()
    assert table.grad is not None and table.grad.shape == (33,)
    assert not tally.syncs, dict(tally.syncs)
