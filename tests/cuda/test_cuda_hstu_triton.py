"""The Triton HSTU attention compiled for CUDA (`model.attention=triton`, what `auto` picks on a
GPU) against the padded attention on the same GPU: outputs and every gradient (q, k, v, the
position and time tables) in float32 within 1e-4 and in bfloat16 within bfloat16's resolution,
on jagged batches with empty, length-1 and full sequences, candidates, with and without the
relative bias; and the same bits on every run (no atomics: what the bitwise plan tests on CUDA
rely on). Imports only torch, triton and the torch-only attention module, so it runs in the GPU
check's first, torch-only step. Speed is `recsys-bench hstu_gpu`'s."""

from __future__ import annotations

import os

import pytest
import torch

CPU_COUNTERPART = "tests/unit/test_hstu_triton.py runs the same kernels in Triton's interpreter on CPU"

# the values, not the speed: one config per kernel, no autotuning compiles (set before the import)
os.environ.setdefault("RECSYS_HSTU_TRITON_AUTOTUNE", "0")

N, HEADS, WIDTH = 300, 2, 64
LENGTHS = [0, 1, N, 129, 64, 5, 200]
CANDIDATES = [0, 1, 8, 3, 0, 5, 16]


def _kernels():
    pytest.importorskip("triton", reason="the CUDA torch brings triton; this one has none")
    from recsys_pipe.models import hstu_triton

    if hstu_triton.INTERPRETED:
        pytest.skip("TRITON_INTERPRET is set: the kernels were made for the CPU interpreter")
    return hstu_triton


def _case(dtype: torch.dtype, seed: int = 0):
    from recsys_pipe.models.hstu_attention import RelativeBias

    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = torch.tensor(LENGTHS, device="cuda")
    offsets = torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"), lengths.cumsum(0)])
    total = int(offsets[-1])
    q, k, v = (torch.randn(total, HEADS, WIDTH, device="cuda", generator=gen, dtype=dtype) for _ in "qkv")
    torch.manual_seed(seed)
    bias = RelativeBias(N, 32).cuda()
    with torch.no_grad():
        bias.position.normal_(0.0, 0.5)
        bias.time.normal_(0.0, 0.5)
    gaps = torch.randint(0, 30 * 86_400, (total,), device="cuda", generator=gen)
    return lengths, offsets, q, k, v, bias, gaps.cumsum(0)


def _padded(q, k, v, lengths, offsets, candidates, bias, times):
    from recsys_pipe.models.hstu_attention import attention_mask, padded_attention

    total, b = q.shape[0], lengths.shape[0]
    rows = torch.cat([i * N + torch.arange(int(n), device="cuda") for i, n in enumerate(lengths.tolist())])
    qkv = torch.cat([t.reshape(total, -1) for t in (q, k, v)], dim=-1)
    full = qkv.new_zeros(b * N, qkv.shape[1]).index_copy(0, rows, qkv).view(b, N, -1)
    mask = attention_mask(lengths, candidates, N)
    full_bias = None
    if bias is not None:
        padded_times = torch.zeros(b * N, dtype=torch.long, device="cuda").index_copy(0, rows, times)
        full_bias = bias(padded_times.view(b, N))
    out = padded_attention(full, mask, full_bias, HEADS)
    return out.reshape(b * N, -1)[rows].view(total, HEADS, WIDTH)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no bias", "relative bias"])
def test_triton_attention_equals_padded_on_cuda(dtype: torch.dtype, with_bias: bool) -> None:
    kernels = _kernels()
    lengths, offsets, q, k, v, bias, times = _case(dtype)
    candidates = torch.tensor(CANDIDATES, device="cuda")
    inputs = [t.requires_grad_() for t in (q, k, v)]
    if with_bias:
        inputs += [bias.position, bias.time]
    out = kernels.jagged_hstu_attention(q, k, v, offsets, N, candidates, bias.jagged(times) if with_bias else None)
    ref = _padded(q, k, v, lengths, offsets, candidates, bias if with_bias else None, times)
    grad = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9)).to(dtype)
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(ref, inputs, grad)
    # float32: both multiply in float32 (no TF32), sums in other orders; bfloat16: the padded path
    # rounds its scores and weights to bfloat16 where the kernels accumulate in float32
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    for name, a, b in zip(["dq", "dk", "dv", "dposition", "dtime"], got, want):
        scale = float(b.float().abs().max())
        torch.testing.assert_close(a.float() / scale, b.float() / scale, **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_triton_attention_gives_the_same_bits_every_run() -> None:
    kernels = _kernels()
    lengths, offsets, q, k, v, bias, times = _case(torch.bfloat16, seed=3)
    candidates = torch.tensor(CANDIDATES, device="cuda")
    runs = []
    for _ in range(2):
        qs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = kernels.jagged_hstu_attention(*qs, offsets, N, candidates, bias.jagged(times))
        runs.append([out, *torch.autograd.grad(out.float().sum(), [*qs, bias.position, bias.time])])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
