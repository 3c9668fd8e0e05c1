"""The attention of the HSTU blocks on padded tensors, and its relative bias: plain torch (no
torchrec, no fbgemm), so that the attention alone runs where only torch is installed (the
attention benchmark and the CUDA tests of the Triton kernels, `recsys_pipe.models.hstu_triton`,
which compute the same function on jagged tensors). `recsys_pipe.models.hstu` builds the model
from these pieces; `model.attention` chooses between the two (`uses_triton`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from recsys_pipe.models.hstu_triton import JaggedBias

__all__ = [
    "TIME_BUCKET_WIDTH",
    "MaskStatics",
    "RelativeBias",
    "SummedBackwardLookup",
    "attention_mask",
    "bias_lookup",
    "padded_attention",
    "triton_available",
    "uses_triton",
]

TIME_BUCKET_WIDTH = 0.301
"""Time gaps are bucketed by `ln(gap_seconds) / TIME_BUCKET_WIDTH` (generative-recommenders'
choice): each bucket spans a factor of ~1.35; 64 buckets reach about 7 years."""


def uses_triton(attention: str, device: torch.device) -> bool:
    """Whether `model.attention` (`auto`, `padded`, `triton`) runs the fused Triton kernels on
    tensors of `device`: `triton` always (the launcher refused it where it cannot run:
    `HSTUConfig.check_device`), `auto` on CUDA where Triton imports."""
    if attention == "auto":
        return device.type == "cuda" and triton_available()
    return attention == "triton"


def triton_available() -> bool:
    """Whether `triton` imports here (cached)."""
    global _TRITON
    if _TRITON is None:
        try:
            import triton  # noqa: F401

            _TRITON = True
        except ImportError:
            _TRITON = False
    return _TRITON


_TRITON: bool | None = None


def bias_lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`table[index]` for a small 1-d bias table read at many positions (the attention bias: B*N*N
    reads of a few dozen time buckets), with a backward that is fast on the device it runs on.

    The gradient sums millions of positions into a few dozen entries, most of them into one or two
    (gaps of days fall in the last time buckets). On CUDA, indexing's backward (`index_put_` with
    accumulation) sums each entry's positions serially: at batch 1024 that took 98 % of an HSTU
    step's GPU time (32 ms per call, H100). There `SummedBackwardLookup` sorts the positions by
    entry and sums each entry's run in parallel (deterministic, as the indexing is). On the CPU,
    indexing's backward is the fastest way."""
    if index.is_cuda:
        return SummedBackwardLookup.apply(table, index)
    return table[index]


class SummedBackwardLookup(torch.autograd.Function):
    """`table[index]` whose backward sums the gradient of each table entry with a sort and a
    segmented reduction (`torch.segment_reduce`, a parallel tree per entry) instead of indexing's
    serial accumulation, which a table of a few entries read at millions of positions serialises
    (`bias_lookup`). No atomics: the same inputs give the same bits."""

    @staticmethod
    def forward(ctx: Any, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.entries = table.shape[0]
        return table[index]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        flat = index.reshape(-1)
        ordered, order = torch.sort(flat, stable=True)
        # each entry's run in the sorted positions, found by binary search: `torch.bincount` would
        # size its output by the largest index, a read of a device value (a host sync on CUDA)
        edges = torch.searchsorted(ordered, torch.arange(ctx.entries + 1, device=flat.device))
        per_entry = edges[1:] - edges[:-1]
        # `unsafe`: the lengths sum to the data's length by construction (no check, no host sync)
        summed = torch.segment_reduce(grad.reshape(-1)[order], "sum", lengths=per_entry, unsafe=True)
        return summed, None


class RelativeBias(nn.Module):
    """Learned attention bias from relative position and bucketed log time gap (shared by heads),
    as generative-recommenders' `RelativeBucketedTimeAndPositionBasedBias`: query i and key j
    get `position[j - i + N - 1] + time[bucket(|query_time_i - key_time_j|)]`, both tables
    initialised N(0, 0.02)."""

    def __init__(self, max_len: int, num_time_buckets: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.num_time_buckets = num_time_buckets
        self.position = nn.Parameter(torch.empty(2 * max_len - 1).normal_(0.0, 0.02))
        self.time = nn.Parameter(torch.empty(num_time_buckets + 1).normal_(0.0, 0.02))
        # the position table's index of each (query, key), `j - i + N - 1`: the same every step, so
        # made once (moved with the module; not part of its state)
        pos = torch.arange(max_len)
        self.register_buffer("relative_index", pos[None, :] - pos[:, None] + max_len - 1, persistent=False)

    def bucketize(self, key_times: torch.Tensor, query_times: torch.Tensor | None = None) -> torch.Tensor:
        """Padded `[B, N]` timestamps of the keys and of the queries (default: the keys') -> the
        `[B, N, N]` time bucket of each (query, key): `ln(max(|gap|, 1)) / 0.301`, at most
        `num_time_buckets`. The ranking model's query time is its token's own; the retrieval
        encoder's is the time of the item each position predicts (the reference's
        "ts(next item) - ts(current item)"). Data only: computed once for every layer's bias."""
        query_times = key_times if query_times is None else query_times
        return self.bucket_of_gap((query_times[:, :, None] - key_times[:, None, :]).abs())

    def bucket_of_gap(self, gap: torch.Tensor) -> torch.Tensor:
        """The time bucket of integer gaps >= 0: `ln(max(gap, 1)) / 0.301`, at most
        `num_time_buckets` (monotone in the gap; the Triton attention's buckets are checked
        against this very function, `hstu_triton.bucket_bounds`)."""
        return (torch.log(gap.clamp(min=1).float()) / TIME_BUCKET_WIDTH).long().clamp(max=self.num_time_buckets)

    def jagged(self, query_times: torch.Tensor, key_times: torch.Tensor | None = None) -> JaggedBias:
        """The bias as the Triton attention reads it (`model.attention=triton`): the tables and
        the jagged `[T]` timestamps of the queries and keys (default: the queries')."""
        from recsys_pipe.models.hstu_triton import JaggedBias, bucket_bounds

        bounds = bucket_bounds(self.bucket_of_gap, self.num_time_buckets, TIME_BUCKET_WIDTH, query_times.device)
        key_times = query_times if key_times is None else key_times
        return JaggedBias(self.position, self.time, query_times, key_times, bounds)

    def from_buckets(self, bucket: torch.Tensor) -> torch.Tensor:
        """`[B, N, N]` buckets (`bucketize`) -> the bias `[B, N, N]` (query, key)."""
        position_bias = bias_lookup(self.position, self.relative_index)
        return position_bias[None] + bias_lookup(self.time, bucket)

    def forward(self, key_times: torch.Tensor, query_times: torch.Tensor | None = None) -> torch.Tensor:
        """Padded `[B, N]` timestamps -> bias `[B, N, N]` (`bucketize`, then `from_buckets`)."""
        return self.from_buckets(self.bucketize(key_times, query_times))


def padded_attention(qkv: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None, heads: int) -> torch.Tensor:
    """Padded `[B, N, 3D]` queries, keys, values (each `heads` heads wide), the `[B, N, N]` mask
    (`attention_mask`) and bias -> the attention output `[B, N, D]`: `SiLU(q k^T + bias) / N`
    where the mask allows, times v."""
    b, n, h = qkv.shape[0], qkv.shape[1], heads
    q, k, v = qkv.view(b, n, 3, h, -1).unbind(dim=2)
    scores = torch.einsum("bnhd,bmhd->bhnm", q, k)
    if bias is not None:
        scores = scores + bias[:, None]
    attn = F.silu(scores) / n * mask[:, None]
    return torch.einsum("bhnm,bmhd->bnhd", attn, v).reshape(b, n, -1)


def attention_mask(
    lengths: torch.Tensor, num_candidates: torch.Tensor, n: int, static: MaskStatics | None = None
) -> torch.Tensor:
    """`[B, N, N]` float mask: causal over valid tokens; candidate keys only for themselves.
    `static`: the parts that do not depend on the batch, made once by the caller (default: made
    here, on the lengths' device)."""
    static = static if static is not None else MaskStatics(n).to(lengths.device)
    pos = static.positions
    valid = pos[None] < lengths[:, None]
    candidate = valid & (pos[None] >= (lengths - num_candidates)[:, None])
    allowed = valid[:, :, None] & valid[:, None, :] & static.causal & (~candidate[:, None, :] | static.eye)
    return allowed.float()


class MaskStatics(nn.Module):
    """What `attention_mask` reuses from step to step at length `n`: the positions `[N]`, the
    causal mask and the identity `[N, N]` (buffers: they move with the model and are not part
    of its state)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        pos = torch.arange(n)
        self.register_buffer("positions", pos, persistent=False)
        self.register_buffer("causal", pos[:, None] >= pos[None, :], persistent=False)
        self.register_buffer("eye", torch.eye(n, dtype=torch.bool), persistent=False)
