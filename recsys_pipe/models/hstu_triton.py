"""HSTU attention on jagged sequences as fused Triton kernels, forward and backward
(`model.attention=triton`).

What it computes is exactly `HSTULayer._attend` on the padded layout, without the padding: for
each sequence b of length L (offsets[b] .. offsets[b + 1] of the jagged `[T, H, d]` tensors) and
each head, query i and key j (positions within the sequence)

    A[i, j] = SiLU(q_i . k_j + pos[j - i + N - 1] + time[bucket(|t_i - t_j|)]) / N   if allowed
    out_i   = sum_j A[i, j] v_j

where N is the model's padded length (`max_len`: the divisor and the size of the position
table), the relative bias is optional, and (i, j) is allowed when j <= i and key j is not a
candidate other than i itself (the last `num_candidates[b]` tokens of the sequence are the
candidates: they see the history and themselves, never each other). Nothing of size
`[B, N, N]` is ever made; each program works on a tile of queries by keys of one sequence and
head, and recomputes the scores it needs in the backward rather than storing them.

The kernels, one program per tile row of one (sequence, head):

* `_fwd_kernel`: a block of queries, over the key blocks up to its diagonal.
* `_dkdv_kernel`: a block of keys, over the query blocks from its diagonal on: dk, dv.
* `_dq_kernel`: a block of queries, over its key blocks: dq.
* `_bias_grad_kernel` (with the bias only): the tiles of one block diagonal (query block minus
  key block = Δ), accumulating dS tile on tile, so that the position-bias gradient (a sum along
  each diagonal j - i) is one reduction per program; the time-bucket gradient sums each tile's
  dS per bucket over the range of buckets the tile holds.

No atomics anywhere: every output element is written by one program, the bias gradients go to
per-program partial sums that torch adds up, so the same inputs give the same bits (as
`SummedBackwardLookup` does for the padded path), and every plan stays bitwise serial's on CUDA.

Time buckets: `RelativeBias` buckets a gap g with torch (`bucket_of_gap`); the kernels must
agree to the bit, although their `log` is not torch's. So they take the estimate from `log`
and correct it by one against `bucket_bounds`, the smallest gap of each bucket found with torch
itself on the device (a binary search, once per device), which makes the kernels' buckets
exactly torch's.

Written for the Triton that ships with torch 2.11 and later (Triton 3.3+): `tl.dot` with
`input_precision` (ieee for float32 inputs, so float32 is not silently TF32), `tl.trans`,
`tl.where`, `tl.sigmoid`, dynamic `range` bounds, `triton.autotune` with `early_config_prune`. On
the CPU it runs in Triton's interpreter (`TRITON_INTERPRET=1` set before Triton is imported),
which is how CI tests it; on CUDA the block sizes are autotuned per (N, head width, bias,
dtype), so a first run on a new card measures without code edits.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = [
    "INTERPRETED",
    "JaggedBias",
    "bucket_bounds",
    "jagged_hstu_attention",
    "runs_on",
]

#: True when this module's kernels were made by Triton's interpreter (TRITON_INTERPRET=1 when Triton
#: was imported): they then run on CPU tensors, slowly, and not on CUDA ones
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: the interpreter's one block size (the smallest `tl.dot` accepts): small tests stay fast
_INTERPRETER_BLOCK = 16


def runs_on(device: torch.device) -> bool:
    """Whether these kernels run on tensors of `device`: CUDA when compiled, the CPU when
    interpreted."""
    return device.type == ("cpu" if INTERPRETED else "cuda")


#: RECSYS_HSTU_TRITON_AUTOTUNE=0: every kernel takes its first config, untuned (tests that check
#: values, not speed, and would otherwise compile every config of every kernel)
AUTOTUNE = os.environ.get("RECSYS_HSTU_TRITON_AUTOTUNE", "1") != "0"


def _prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """`early_config_prune`: the interpreter runs one small block size (no benchmarking on the
    CPU); with autotuning off, the first config."""
    if INTERPRETED:
        meta = dict.fromkeys(configs[0].kwargs, _INTERPRETER_BLOCK)
        return [triton.Config(meta, num_warps=1, num_stages=1)]
    return configs if AUTOTUNE else configs[:1]


def _config(warps: int, stages: int, **blocks: int) -> Any:
    return triton.Config(blocks, num_warps=warps, num_stages=stages)


# a few shapes each: every config of a kernel compiles once per key on a first run
_FWD_CONFIGS = [
    _config(4, 2, BLOCK_M=64, BLOCK_N=64),
    _config(8, 2, BLOCK_M=128, BLOCK_N=64),
    _config(4, 3, BLOCK_M=128, BLOCK_N=32),
    _config(4, 3, BLOCK_M=64, BLOCK_N=32),
]
_BWD_CONFIGS = [
    _config(4, 2, BLOCK_M=64, BLOCK_N=64),
    _config(4, 2, BLOCK_M=32, BLOCK_N=64),
    _config(8, 2, BLOCK_M=64, BLOCK_N=128),
    _config(4, 3, BLOCK_M=32, BLOCK_N=32),
]
_SQUARE_CONFIGS = [_config(4, 2, BLOCK=32), _config(4, 2, BLOCK=64), _config(8, 2, BLOCK=64)]
_PRUNE = {"early_config_prune": _prune}
_KEY = ["MAX_LEN", "BLOCK_D", "HAS_BIAS", "HAS_CANDIDATES"]


# -- pieces every kernel shares ------------------------------------------------------------------


@triton.jit
def _sequence(OFFSETS, NUM_CAND, b, HAS_CANDIDATES: tl.constexpr):
    """(first token, length, history length) of sequence b."""
    start = tl.load(OFFSETS + b).to(tl.int64)
    length = (tl.load(OFFSETS + b + 1) - start).to(tl.int32)
    history = length
    if HAS_CANDIDATES:
        history = length - tl.load(NUM_CAND + b).to(tl.int32)
    return start, length, history


@triton.jit
def _rows(PTR, start, offs, row_stride, head_offset, offs_d, length, D):
    """Rows `offs` (positions within the sequence) of one head, `[len(offs), BLOCK_D]`, zero
    outside the sequence and beyond the head width."""
    ptrs = PTR + (start + offs)[:, None] * row_stride + head_offset + offs_d[None, :]
    return tl.load(ptrs, mask=(offs < length)[:, None] & (offs_d < D)[None, :], other=0.0)


@triton.jit
def _bucket(gap, BOUNDS, NUM_BUCKETS: tl.constexpr, BUCKET_WIDTH: tl.constexpr):
    """Time bucket of an int64 gap >= 0, equal to `bucket_of_gap`'s: a `log` estimate corrected
    by one against the smallest gap of each bucket."""
    g = tl.maximum(gap, 1)
    est = (tl.log(g.to(tl.float32)) / BUCKET_WIDTH).to(tl.int32)
    est = tl.minimum(tl.maximum(est, 0), NUM_BUCKETS)
    est = tl.where(g < tl.load(BOUNDS + est), est - 1, est)
    est = tl.where(g >= tl.load(BOUNDS + est + 1), est + 1, est)
    return est


@triton.jit
def _allowed(offs_m, offs_n, length, history):
    """The attention mask of a tile: causal, inside the sequence, candidates only for themselves."""
    m, n = offs_m[:, None], offs_n[None, :]
    return (m < length) & (n <= m) & ((n < history) | (n == m))


@triton.jit
def _scores(
    q,
    kT,
    offs_m,
    offs_n,
    allowed,
    qt,
    kt,
    POS,
    TIME,
    BOUNDS,
    MAX_LEN,
    HAS_BIAS: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    BUCKET_WIDTH: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """q k^T plus the relative bias (position, then time, added as `RelativeBias` adds them), and
    the tile's time buckets (zeros without the bias)."""
    s = tl.dot(q, kT, input_precision=PRECISION)
    bucket = tl.zeros(s.shape, dtype=tl.int32)
    if HAS_BIAS:
        rel = offs_n[None, :] - offs_m[:, None] + MAX_LEN - 1
        position = tl.load(POS + rel, mask=allowed, other=0.0)
        bucket = _bucket(tl.abs(qt[:, None] - kt[None, :]), BOUNDS, NUM_BUCKETS, BUCKET_WIDTH)
        bucket = tl.where(allowed, bucket, 0)
        s = s + (position + tl.load(TIME + bucket, mask=allowed, other=0.0))
    return s, bucket


@triton.jit
def _times(QT, KT, start, offs_m, offs_n, length, HAS_BIAS: tl.constexpr):
    """Query and key timestamps of a tile (zeros without the bias)."""
    qt = tl.zeros(offs_m.shape, dtype=tl.int64)
    kt = tl.zeros(offs_n.shape, dtype=tl.int64)
    if HAS_BIAS:
        qt = tl.load(QT + start + offs_m, mask=offs_m < length, other=0).to(tl.int64)
        kt = tl.load(KT + start + offs_n, mask=offs_n < length, other=0).to(tl.int64)
    return qt, kt


@triton.jit
def _smallest(x):
    return tl.min(tl.min(x, axis=1), axis=0)


@triton.jit
def _score_grad(s, dp, allowed, MAX_LEN):
    """dL/ds from dL/dA, where A = SiLU(s) / N where allowed, else 0."""
    sig = tl.sigmoid(s)
    return tl.where(allowed, dp * (sig * (1.0 + s * (1.0 - sig))) / MAX_LEN, 0.0)


# -- forward -------------------------------------------------------------------------------------


@triton.autotune(configs=_FWD_CONFIGS, key=_KEY, prune_configs_by=_PRUNE)
@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    OUT,
    OFFSETS,
    NUM_CAND,
    QT,
    KT,
    POS,
    TIME,
    BOUNDS,
    stride_t,
    stride_out,
    H,
    D,
    MAX_LEN,
    HAS_BIAS: tl.constexpr,
    HAS_CANDIDATES: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    BUCKET_WIDTH: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    start, length, history = _sequence(OFFSETS, NUM_CAND, b, HAS_CANDIDATES)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 < length:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q = _rows(Q, start, offs_m, stride_t, h * D, offs_d, length, D)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n0 in range(0, tl.minimum(m0 + BLOCK_M, length), BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k = _rows(K, start, offs_n, stride_t, h * D, offs_d, length, D)
            v = _rows(V, start, offs_n, stride_t, h * D, offs_d, length, D)
            allowed = _allowed(offs_m, offs_n, length, history)
            qt, kt = _times(QT, KT, start, offs_m, offs_n, length, HAS_BIAS)
            s, _ = _scores(
                q, tl.trans(k), offs_m, offs_n, allowed, qt, kt, POS, TIME, BOUNDS, MAX_LEN,
                HAS_BIAS, NUM_BUCKETS, BUCKET_WIDTH, PRECISION,
            )  # fmt: skip
            a = tl.where(allowed, s * tl.sigmoid(s) / MAX_LEN, 0.0)
            acc += tl.dot(a.to(v.dtype), v, input_precision=PRECISION)
        ptrs = OUT + (start + offs_m)[:, None] * stride_out + h * D + offs_d[None, :]
        tl.store(ptrs, acc.to(OUT.dtype.element_ty), mask=(offs_m < length)[:, None] & (offs_d < D)[None, :])


# -- backward ------------------------------------------------------------------------------------


@triton.autotune(configs=_BWD_CONFIGS, key=_KEY, prune_configs_by=_PRUNE)
@triton.jit
def _dkdv_kernel(
    Q,
    K,
    V,
    DOUT,
    DK,
    DV,
    OFFSETS,
    NUM_CAND,
    QT,
    KT,
    POS,
    TIME,
    BOUNDS,
    stride_t,
    stride_dout,
    stride_grad,
    H,
    D,
    MAX_LEN,
    HAS_BIAS: tl.constexpr,
    HAS_CANDIDATES: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    BUCKET_WIDTH: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    start, length, history = _sequence(OFFSETS, NUM_CAND, b, HAS_CANDIDATES)
    n0 = tl.program_id(0) * BLOCK_N
    if n0 < length:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        k = _rows(K, start, offs_n, stride_t, h * D, offs_d, length, D)
        v = _rows(V, start, offs_n, stride_t, h * D, offs_d, length, D)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        # a block of candidate keys is seen only by the same positions' queries
        end = tl.where(n0 < history, length, tl.minimum(n0 + BLOCK_N, length))
        for m0 in range((n0 // BLOCK_M) * BLOCK_M, end, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            q = _rows(Q, start, offs_m, stride_t, h * D, offs_d, length, D)
            do = _rows(DOUT, start, offs_m, stride_dout, h * D, offs_d, length, D)
            allowed = _allowed(offs_m, offs_n, length, history)
            qt, kt = _times(QT, KT, start, offs_m, offs_n, length, HAS_BIAS)
            s, _ = _scores(
                q, tl.trans(k), offs_m, offs_n, allowed, qt, kt, POS, TIME, BOUNDS, MAX_LEN,
                HAS_BIAS, NUM_BUCKETS, BUCKET_WIDTH, PRECISION,
            )  # fmt: skip
            a = tl.where(allowed, s * tl.sigmoid(s) / MAX_LEN, 0.0)
            dv += tl.dot(tl.trans(a.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = _score_grad(s, dp, allowed, MAX_LEN)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
        mask = (offs_n < length)[:, None] & (offs_d < D)[None, :]
        rows = (start + offs_n)[:, None] * stride_grad + h * D + offs_d[None, :]
        tl.store(DK + rows, dk.to(DK.dtype.element_ty), mask=mask)
        tl.store(DV + rows, dv.to(DV.dtype.element_ty), mask=mask)


@triton.autotune(configs=_BWD_CONFIGS, key=_KEY, prune_configs_by=_PRUNE)
@triton.jit
def _dq_kernel(
    Q,
    K,
    V,
    DOUT,
    DQ,
    OFFSETS,
    NUM_CAND,
    QT,
    KT,
    POS,
    TIME,
    BOUNDS,
    stride_t,
    stride_dout,
    stride_grad,
    H,
    D,
    MAX_LEN,
    HAS_BIAS: tl.constexpr,
    HAS_CANDIDATES: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    BUCKET_WIDTH: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    start, length, history = _sequence(OFFSETS, NUM_CAND, b, HAS_CANDIDATES)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 < length:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q = _rows(Q, start, offs_m, stride_t, h * D, offs_d, length, D)
        do = _rows(DOUT, start, offs_m, stride_dout, h * D, offs_d, length, D)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n0 in range(0, tl.minimum(m0 + BLOCK_M, length), BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k = _rows(K, start, offs_n, stride_t, h * D, offs_d, length, D)
            v = _rows(V, start, offs_n, stride_t, h * D, offs_d, length, D)
            allowed = _allowed(offs_m, offs_n, length, history)
            qt, kt = _times(QT, KT, start, offs_m, offs_n, length, HAS_BIAS)
            s, _ = _scores(
                q, tl.trans(k), offs_m, offs_n, allowed, qt, kt, POS, TIME, BOUNDS, MAX_LEN,
                HAS_BIAS, NUM_BUCKETS, BUCKET_WIDTH, PRECISION,
            )  # fmt: skip
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = _score_grad(s, dp, allowed, MAX_LEN)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        ptrs = DQ + (start + offs_m)[:, None] * stride_grad + h * D + offs_d[None, :]
        tl.store(ptrs, dq.to(DQ.dtype.element_ty), mask=(offs_m < length)[:, None] & (offs_d < D)[None, :])


@triton.autotune(configs=_SQUARE_CONFIGS, key=_KEY, prune_configs_by=_PRUNE)
@triton.jit
def _bias_grad_kernel(
    Q,
    K,
    V,
    DOUT,
    POS_PART,
    TIME_PART,
    OFFSETS,
    NUM_CAND,
    QT,
    KT,
    POS,
    TIME,
    BOUNDS,
    stride_t,
    stride_dout,
    H,
    D,
    MAX_LEN,
    NUM_DIAGONALS,
    HAS_BIAS: tl.constexpr,
    HAS_CANDIDATES: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    BUCKET_WIDTH: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BUCKETS_P2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (Δ, sequence and head): the tiles (query block kb + Δ, key block kb). Writes the
    sum of their dS tiles to POS_PART[bh, Δ] (`[BLOCK, BLOCK]`: every tile of one block diagonal
    has the same relative position at the same place, so torch sums its diagonals once,
    `_overlap_add`), and the sums of dS per time bucket to TIME_PART[bh, Δ, :]."""
    diagonal = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    start, length, history = _sequence(OFFSETS, NUM_CAND, b, HAS_CANDIDATES)
    offs_d = tl.arange(0, BLOCK_D)
    ii = tl.arange(0, BLOCK)
    by_diagonal = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    by_bucket = tl.zeros([BUCKETS_P2], dtype=tl.float32)
    buckets = tl.arange(0, BUCKETS_P2)
    first_m = diagonal * BLOCK
    if first_m < length:
        for m0 in range(first_m, length, BLOCK):
            offs_m = m0 + ii
            offs_n = m0 - first_m + ii
            q = _rows(Q, start, offs_m, stride_t, h * D, offs_d, length, D)
            do = _rows(DOUT, start, offs_m, stride_dout, h * D, offs_d, length, D)
            k = _rows(K, start, offs_n, stride_t, h * D, offs_d, length, D)
            v = _rows(V, start, offs_n, stride_t, h * D, offs_d, length, D)
            allowed = _allowed(offs_m, offs_n, length, history)
            qt, kt = _times(QT, KT, start, offs_m, offs_n, length, HAS_BIAS)
            s, bucket = _scores(
                q, tl.trans(k), offs_m, offs_n, allowed, qt, kt, POS, TIME, BOUNDS, MAX_LEN,
                HAS_BIAS, NUM_BUCKETS, BUCKET_WIDTH, PRECISION,
            )  # fmt: skip
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = _score_grad(s, dp, allowed, MAX_LEN)
            by_diagonal += ds
            # each bucket the tile holds, in increasing order (a tile's gaps fall in few buckets)
            t = _smallest(tl.where(allowed, bucket, NUM_BUCKETS + 1))
            while t <= NUM_BUCKETS:
                total = tl.sum(tl.sum(tl.where(allowed & (bucket == t), ds, 0.0), axis=1), axis=0)
                by_bucket += tl.where(buckets == t, total, 0.0)
                t = _smallest(tl.where(allowed & (bucket > t), bucket, NUM_BUCKETS + 1))
    row = pid_bh * NUM_DIAGONALS + diagonal
    tile = (row * BLOCK + ii[:, None]) * BLOCK + ii[None, :]
    tl.store(POS_PART + tile, by_diagonal)
    tl.store(TIME_PART + row * BUCKETS_P2 + buckets, by_bucket)


# -- host side -----------------------------------------------------------------------------------


class JaggedBias:
    """The relative bias as the kernels read it: the position table `[2N - 1]`, the time table
    `[num_buckets + 1]`, jagged query and key timestamps `[T]` (the same tensor for the ranking
    model) and the buckets' smallest gaps (`bucket_bounds`)."""

    __slots__ = ("bounds", "key_times", "position", "query_times", "time")

    def __init__(
        self,
        position: torch.Tensor,
        time: torch.Tensor,
        query_times: torch.Tensor,
        key_times: torch.Tensor,
        bounds: torch.Tensor,
    ) -> None:
        self.position, self.time = position, time
        self.query_times, self.key_times, self.bounds = query_times, key_times, bounds


_BOUNDS: dict[tuple[str, int, float], torch.Tensor] = {}


def bucket_bounds(bucket_of_gap: Any, num_buckets: int, width: float, device: torch.device) -> torch.Tensor:
    """int64 `[num_buckets + 2]`: entry b is the smallest gap g >= 1 whose bucket
    (`bucket_of_gap(g)`, torch on `device`) is at least b (entry 0 is 0, the last int64's max).
    A binary search over the gaps, all buckets at once, with torch ops on the device (no host
    sync); cached per device. Exact because `bucket_of_gap` is monotone in the gap."""
    key = (str(device), num_buckets, width)
    found = _BOUNDS.get(key)
    if found is None:
        targets = torch.arange(1, num_buckets + 1, device=device)
        low = torch.ones(num_buckets, dtype=torch.int64, device=device)
        high = torch.full((num_buckets,), 2**62, dtype=torch.int64, device=device)
        for _ in range(63):
            mid = (low + high) // 2
            reached = bucket_of_gap(mid) >= targets
            high = torch.where(reached, mid, high)
            low = torch.where(reached, low, mid + 1)
        edge = torch.tensor([0], dtype=torch.int64, device=device)
        found = torch.cat([edge, high, torch.full_like(edge, torch.iinfo(torch.int64).max)])
        _BOUNDS[key] = found
    return found


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs are multiplied in float32, as torch's padded einsum does (not TF32)
    return "ieee" if dtype == torch.float32 else "tf32"


class _JaggedAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        offsets: torch.Tensor,
        num_candidates: torch.Tensor | None,
        max_len: int,
        position: torch.Tensor | None,
        time: torch.Tensor | None,
        query_times: torch.Tensor | None,
        key_times: torch.Tensor | None,
        bounds: torch.Tensor | None,
        bucket_width: float,
    ) -> torch.Tensor:
        total, heads, d = q.shape
        out = torch.empty((total, heads, d), dtype=q.dtype, device=q.device)
        args = _Launch(q, k, v, offsets, num_candidates, max_len, position, time, query_times, key_times, bounds)
        args.bucket_width = bucket_width
        if total:
            _fwd_kernel[lambda meta: (triton.cdiv(max_len, meta["BLOCK_M"]), args.sequences * heads)](
                q, k, v, out, *args.geometry, q.stride(0), out.stride(0), heads, d, max_len, **args.flags
            )
        ctx.save_for_backward(q, k, v, offsets, *args.saved_optional())
        ctx.launch = args
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, offsets, *optional = ctx.saved_tensors
        args: _Launch = ctx.launch
        args.restore(q, k, v, offsets, optional)
        total, heads, d = q.shape
        if dout.stride(-1) != 1 or dout.stride(1) != d:
            dout = dout.contiguous()
        dq, dk, dv = (torch.empty((total, heads, d), dtype=q.dtype, device=q.device) for _ in range(3))
        dpos = dtime = None
        max_len, bh = args.max_len, args.sequences * heads
        if total:
            common = (*args.geometry, q.stride(0), dout.stride(0), dq.stride(0), heads, d, max_len)
            _dkdv_kernel[lambda meta: (triton.cdiv(max_len, meta["BLOCK_N"]), bh)](
                q, k, v, dout, dk, dv, *common, **args.flags
            )
            _dq_kernel[lambda meta: (triton.cdiv(max_len, meta["BLOCK_M"]), bh)](
                q, k, v, dout, dq, *common, **args.flags
            )
        if args.position is not None:
            dpos, dtime = _bias_grads(args, q, k, v, dout, total)
        return dq, dk, dv, None, None, None, dpos, dtime, None, None, None, None


class _Launch:
    """What the three launches of one attention call share (kept on the autograd context)."""

    def __init__(self, q, k, v, offsets, num_candidates, max_len, position, time, query_times, key_times, bounds):
        self.max_len = max_len
        self.sequences = offsets.shape[0] - 1
        self.position, self.time, self.bounds = position, time, bounds
        self.query_times, self.key_times = query_times, key_times
        self.num_candidates = num_candidates
        self.offsets = offsets
        self.block_d = _block_d(q.shape[2])
        self.precision = _precision(q.dtype)
        self.bucket_width = 0.0

    @property
    def geometry(self) -> tuple[Any, ...]:
        """OFFSETS, NUM_CAND, QT, KT, POS, TIME, BOUNDS (unused pointers: the offsets)."""
        off = self.offsets
        cand = self.num_candidates if self.num_candidates is not None else off
        if self.position is None:
            return off, cand, off, off, off, off, off
        return off, cand, self.query_times, self.key_times, self.position, self.time, self.bounds

    @property
    def flags(self) -> dict[str, Any]:
        return {
            "HAS_BIAS": self.position is not None,
            "HAS_CANDIDATES": self.num_candidates is not None,
            "NUM_BUCKETS": 0 if self.time is None else self.time.shape[0] - 1,
            "BUCKET_WIDTH": self.bucket_width,
            "PRECISION": self.precision,
            "BLOCK_D": self.block_d,
        }

    def saved_optional(self) -> list[torch.Tensor]:
        return [
            t
            for t in (self.num_candidates, self.position, self.time, self.query_times, self.key_times, self.bounds)
            if t is not None
        ]

    def restore(self, q, k, v, offsets, optional: list[torch.Tensor]) -> None:
        """Put back the tensors `saved_optional` saved (autograd's saved copies)."""
        self.offsets = offsets
        it = iter(optional)
        if self.num_candidates is not None:
            self.num_candidates = next(it)
        if self.position is not None:
            self.position, self.time, self.query_times, self.key_times, self.bounds = (next(it) for _ in range(5))


def _bias_grads(
    args: _Launch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the position and time tables: the kernel's per-program partial sums, added
    up by torch in a fixed order (deterministic)."""
    assert args.position is not None and args.time is not None
    n, heads, d = args.max_len, q.shape[1], q.shape[2]
    num_time = args.time.shape[0]
    buckets_p2 = triton.next_power_of_2(num_time)
    bh = args.sequences * heads
    # sized for any config's block: the most diagonals (smallest block) by the largest tile
    blocks = [_INTERPRETER_BLOCK] if INTERPRETED else [c.kwargs["BLOCK"] for c in _SQUARE_CONFIGS]
    diagonals = triton.cdiv(n, min(blocks))
    pos_part = torch.zeros(bh * diagonals * max(blocks) ** 2, device=q.device)
    time_part = torch.zeros((bh, diagonals, buckets_p2), device=q.device)
    chosen = {"BLOCK": min(blocks)}
    if total:

        def grid(meta: dict[str, Any]) -> tuple[int, int]:
            chosen["BLOCK"] = meta["BLOCK"]  # the last call is the run that counts
            return (triton.cdiv(n, meta["BLOCK"]), bh)

        _bias_grad_kernel[grid](
            q, k, v, dout, pos_part, time_part, *args.geometry, q.stride(0), dout.stride(0), heads, d, n, diagonals,
            BUCKETS_P2=buckets_p2, **args.flags,
        )  # fmt: skip
    blk = chosen["BLOCK"]
    used = triton.cdiv(n, blk)  # the diagonals this block size has (autotuning may have left others)
    tiles = pos_part[: bh * diagonals * blk * blk].view(bh, diagonals, blk, blk)[:, :used].sum(dim=0)
    dpos = _overlap_add(_diagonal_sums(tiles), n, blk).to(args.position.dtype)
    dtime = time_part[:, :used].sum(dim=(0, 1))[:num_time].to(args.time.dtype)
    return dpos, dtime


def _diagonal_sums(tiles: torch.Tensor) -> torch.Tensor:
    """`[R, B, B]` -> `[R, 2B]`: entry c sums each tile's elements with jj - ii + B - 1 = c (the
    last entry is 0). Each row ii is shifted by ii (reversed columns, padded rows of 2B, read as
    rows of 2B - 1), then the columns are summed: no scatter, the same bits every time."""
    r, b, _ = tiles.shape
    padded = torch.nn.functional.pad(tiles.flip(-1), (0, b))  # [R, B, 2B]
    skewed = padded.reshape(r, -1)[:, : b * (2 * b - 1)].reshape(r, b, 2 * b - 1)
    # column col = ii + (B - 1 - jj), so c = jj - ii + B - 1 = 2B - 2 - col
    sums = skewed.sum(dim=1).flip(-1)
    return torch.nn.functional.pad(sums, (0, 1))


def _overlap_add(per_diagonal: torch.Tensor, n: int, blk: int) -> torch.Tensor:
    """Position-table gradient `[2N - 1]` from the diagonal sums of each block diagonal Δ
    (`[num_Δ, 2 BLOCK]`: entry c is relative position j - i = c - (BLOCK - 1) - Δ·BLOCK, table
    index c + N - BLOCK - Δ·BLOCK). Windows of neighbouring Δ overlap by half: each half is added
    once, in a fixed order."""
    count = per_diagonal.shape[0]
    ordered = per_diagonal.flip(0)  # r = count - 1 - Δ: window r starts at r·BLOCK
    line = per_diagonal.new_zeros((count + 1) * blk)
    line[: count * blk] += ordered[:, :blk].reshape(-1)
    line[blk:] += ordered[:, blk:].reshape(-1)
    base = n - count * blk  # the table index of line[0] (<= 0)
    out = per_diagonal.new_zeros(2 * n - 1)
    top = min(2 * n - 1, base + line.shape[0])
    out[max(base, 0) : top] = line[max(-base, 0) : top - base]
    return out


@torch.compiler.disable  # `trainer.compile`: a graph break here; the kernels are compiled already
def jagged_hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    num_candidates: torch.Tensor | None = None,
    bias: JaggedBias | None = None,
    bucket_width: float = 0.301,
) -> torch.Tensor:
    """HSTU attention (see the module docstring) of jagged `q`, `k`, `v` `[T, H, d]` (each
    head's rows with unit stride; views of a wider projection are fine) over the sequences
    `offsets` `[B + 1]`, with the model's padded length `max_len` (every sequence at most that
    long), the trailing `num_candidates` `[B]` of each sequence, and the relative `bias`.
    Returns `[T, H, d]`; differentiable in q, k, v and the bias tables."""
    d = q.shape[2]
    if not (q.stride() == k.stride() == v.stride() and q.stride(2) == 1 and q.stride(1) == d):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if not runs_on(q.device):
        raise RuntimeError(
            f"the Triton HSTU attention runs on {'CPU' if INTERPRETED else 'CUDA'} tensors here "
            f"(TRITON_INTERPRET={'1' if INTERPRETED else 'unset'} when Triton was imported), got {q.device}"
        )
    if bias is None:
        return _JaggedAttention.apply(
            q, k, v, offsets, num_candidates, max_len, None, None, None, None, None, bucket_width
        )
    return _JaggedAttention.apply(
        q, k, v, offsets, num_candidates, max_len, bias.position, bias.time, bias.query_times,
        bias.key_times, bias.bounds, bucket_width,
    )  # fmt: skip
