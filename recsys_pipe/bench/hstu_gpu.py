"""The HSTU model at production sizes on one GPU: the training step's samples/s, tokens/s, model
TFLOPS and MFU, CPU and GPU ms per step and peak memory, with the padded attention against the
fused Triton one (`model.attention`), and the attention alone (forward + backward) against the
padded path and, given a clone, generative-recommenders' Triton kernel.

    recsys-bench hstu_gpu                         # every shape, both parts (a GPU)
    recsys-bench hstu_gpu --only attention        # the attention alone (needs only torch + triton)
    recsys-bench hstu_gpu --only step --shapes e2e,small_1024
    PYTHONPATH=path/to/generative-recommenders recsys-bench hstu_gpu --gr   # also its Triton attention
    recsys-bench hstu_gpu --quick                 # CI: a tiny shape on the CPU (triton interpreted
                                                  # where TRITON_INTERPRET=1)

The shapes (`SHAPES`): `e2e`, NVIDIA recsys-examples' HSTU training (8 layers, width 1024, 4
heads, Zipf lengths up to 4096, batch 32, bf16), and `e2e_1024` the same up to 1024;
`dlrmv4`, MLPerf DLRMv4's HSTU (3 layers, width 512, 4 heads of 128, length 4096, bf16, the
largest batch of `--dlrmv4-batches` that fits);
`small_256`, `small_1024`, the training benchmark's small model (width 32, 2 layers, 2 heads,
length 32) at those batches. The step is the dense model (`HSTURanker`: blocks, head, loss) on
jagged token embeddings plus an Adam step: the embedding lookup is left out (its cost is
torchrec's, measured by `recsys-bench train`).

FLOPs (`step_flops`, docs/benchmarks.md#hstu-at-production-sizes): per block and forward,
`10 T D^2` for the u,v,q,k and output projections (T the batch's tokens) and `4 D P` for the
attention, P the query/key pairs the mask allows, `sum_b n_b (n_b + 1) / 2 - c_b (c_b - 1) / 2`
(causal, candidates not seeing each other); the head adds `2 C D (D + tasks)` for the C
candidates; backward is twice the forward. MFU divides by the card's dense bf16 peak (`PEAKS`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from recsys_pipe.bench.common import format_summary, summary

__all__ = ["PEAKS", "SHAPES", "Shape", "allowed_pairs", "peak_tflops", "step_flops", "zipf_lengths"]

#: dense bf16 peaks in TFLOPS (no sparsity), by a substring of `torch.cuda.get_device_name()`
PEAKS = {"H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "L40S": 362.05}


@dataclass(frozen=True)
class Shape:
    """One model size: the HSTU config keys, the batch and how its lengths are drawn."""

    layers: int
    width: int
    heads: int
    max_len: int
    batch: int
    candidates: int
    zipf_alpha: float = 1.2
    min_len: int = 16
    relative_bias: bool = True
    time_buckets: int = 64
    tasks: int = 1


SHAPES = {
    "e2e": Shape(layers=8, width=1024, heads=4, max_len=4096, batch=32, candidates=8),
    "e2e_1024": Shape(layers=8, width=1024, heads=4, max_len=1024, batch=32, candidates=8),
    "dlrmv4": Shape(layers=3, width=512, heads=4, max_len=4096, batch=32, candidates=8),
    "small_256": Shape(layers=2, width=32, heads=2, max_len=32, batch=256, candidates=4, min_len=8, time_buckets=32),
    "small_1024": Shape(layers=2, width=32, heads=2, max_len=32, batch=1024, candidates=4, min_len=8, time_buckets=32),
}
#: `--quick`: the whole path on a CPU in seconds
QUICK = Shape(layers=1, width=32, heads=2, max_len=32, batch=3, candidates=2, min_len=4, time_buckets=16)


def zipf_lengths(shape: Shape, gen: torch.Generator) -> torch.Tensor:
    """`[B]` lengths in [min_len, max_len], P(min_len + k) ∝ (k + 1)^-alpha (the synthetic
    source's `zipf`), at least `candidates + 1`."""
    low = max(shape.min_len, shape.candidates + 1)
    k = torch.arange(shape.max_len - low + 1, dtype=torch.float64)
    probs = (k + 1) ** -shape.zipf_alpha
    return low + torch.multinomial(probs / probs.sum(), shape.batch, replacement=True, generator=gen)


def allowed_pairs(lengths: torch.Tensor, candidates: torch.Tensor) -> int:
    """The (query, key) pairs HSTU's mask allows: causal, and a candidate key only for itself."""
    n, c = lengths.long(), candidates.long()
    return int((n * (n + 1) // 2 - c * (c - 1) // 2).sum())


def step_flops(shape: Shape, lengths: torch.Tensor, candidates: torch.Tensor) -> float:
    """Model FLOPs of one training step (forward + backward) of the dense HSTU on a batch with
    these lengths and candidates (module docstring)."""
    d, tokens, cands = shape.width, int(lengths.sum()), int(candidates.sum())
    per_block = 10 * tokens * d * d + 4 * d * allowed_pairs(lengths, candidates)
    forward = shape.layers * per_block + 2 * cands * d * (d + shape.tasks)
    return 3.0 * forward


def peak_tflops(device: torch.device) -> tuple[float | None, str]:
    """The card's dense bf16 peak (TFLOPS) and its name; None where unknown (the CPU)."""
    if device.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAKS.items():
        if key in name:
            return peak, name
    return None, name


# -- inputs ---------------------------------------------------------------------------------------


@dataclass
class Inputs:
    lengths: torch.Tensor  # [B] (host)
    candidates: torch.Tensor  # [B] (host)
    offsets: torch.Tensor  # [B + 1] on the device
    num_candidates: torch.Tensor  # [B] on the device
    timestamps: torch.Tensor  # [T] on the device, increasing within each sequence

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


def make_inputs(shape: Shape, device: torch.device, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    lengths = zipf_lengths(shape, gen)
    candidates = torch.full_like(lengths, shape.candidates)
    gaps = torch.randint(60, 3 * 86_400, (int(lengths.sum()),), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    times = 1_600_000_000 + gaps.cumsum(0)
    return Inputs(lengths, candidates, offsets.to(device), candidates.to(device), times.to(device))


# -- the attention alone --------------------------------------------------------------------------


def attention_variants(shape: Shape, inputs: Inputs, dtype: torch.dtype, gr: Any) -> dict[str, Callable[[], Any]]:
    """name -> a callable that runs the attention's forward and backward once."""
    from recsys_pipe.models.hstu_attention import RelativeBias, attention_mask, padded_attention

    device = inputs.offsets.device
    total, h, n = inputs.tokens, shape.heads, shape.max_len
    d = shape.width // h
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(total, h, d, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(total, h, d, device=device, dtype=dtype, generator=gen)
    bias = RelativeBias(n, shape.time_buckets).to(device)
    lengths = inputs.lengths.to(device)
    # padded layout: row b * N + position of each jagged token (host-built once, as fbgemm's index)
    rows = torch.cat([b * n + torch.arange(int(length)) for b, length in enumerate(inputs.lengths)]).to(device)
    padded_times = torch.zeros(shape.batch * n, dtype=torch.long, device=device).index_copy(0, rows, inputs.timestamps)

    def padded(with_bias: bool) -> Callable[[], Any]:
        def run() -> Any:
            qkv = torch.cat([t.reshape(total, -1) for t in (q, k, v)], dim=-1)
            full = qkv.new_zeros(shape.batch * n, qkv.shape[1]).index_copy(0, rows, qkv).view(shape.batch, n, -1)
            mask = attention_mask(lengths, inputs.num_candidates, n)
            full_bias = bias(padded_times.view(shape.batch, n)) if with_bias else None
            out = padded_attention(full, mask, full_bias, h).reshape(shape.batch * n, -1)[rows]
            return torch.autograd.backward(out, grad.reshape(total, -1))

        return run

    variants = {"padded": padded(True), "padded_no_bias": padded(False)}
    try:
        from recsys_pipe.models.hstu_triton import jagged_hstu_attention, runs_on
    except ImportError:
        return variants
    if not runs_on(device):
        return variants

    def triton_run(with_bias: bool) -> Callable[[], Any]:
        def run() -> Any:
            jagged_bias = bias.jagged(inputs.timestamps) if with_bias else None
            out = jagged_hstu_attention(q, k, v, inputs.offsets, n, inputs.num_candidates, jagged_bias)
            return torch.autograd.backward(out, grad)

        return run

    variants["triton"] = triton_run(True)
    variants["triton_no_bias"] = triton_run(False)
    if gr is not None:

        def gr_run() -> Any:
            out = gr(N=n, alpha=1.0, q=q, k=k, v=v, seq_offsets=inputs.offsets, num_targets=inputs.num_candidates)
            return torch.autograd.backward(out, grad)

        variants["gr_triton_no_bias"] = gr_run
    return variants


# -- the training step ----------------------------------------------------------------------------


def step_variant(shape: Shape, inputs: Inputs, attention: str, dtype: torch.dtype) -> Callable[[], Any]:
    """One training step of the dense HSTU with `model.attention=attention`: forward under
    autocast (bf16 on CUDA), backward, Adam."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    from recsys_pipe.data.batch import ACTION_KEY, ITEM_KEY, DataSpec
    from recsys_pipe.models.hstu import HSTURanker
    from recsys_pipe.models.hstu_config import HSTUConfig

    device = inputs.offsets.device
    cfg = HSTUConfig(
        embedding_dim=shape.width,
        num_layers=shape.layers,
        num_heads=shape.heads,
        max_seq_len=shape.max_len,
        relative_bias=shape.relative_bias,
        num_time_buckets=shape.time_buckets,
        attention=attention,  # type: ignore[arg-type]
    )
    spec = DataSpec(num_tasks=shape.tasks, vocab_sizes={ITEM_KEY: 1000, ACTION_KEY: 4})
    torch.manual_seed(0)
    ranker = HSTURanker(cfg, spec).to(device)
    opt = torch.optim.Adam(ranker.parameters(), lr=1e-4)
    gen = torch.Generator(device=device).manual_seed(1)
    total, d = inputs.tokens, shape.width
    lengths = inputs.lengths.to(device=device, dtype=torch.int32)
    items = JaggedTensor(values=torch.randn(total, d, device=device, generator=gen) * 0.1, lengths=lengths)
    actions = JaggedTensor(values=torch.zeros(total, d, device=device), lengths=lengths)
    labels = torch.randint(0, 2, (int(inputs.candidates.sum()), shape.tasks), device=device, generator=gen).float()
    embeddings = {ITEM_KEY: items, ACTION_KEY: actions}
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def run() -> Any:
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss, _ = ranker(embeddings, inputs.timestamps, inputs.num_candidates, labels)
        loss.backward()
        opt.step()

    return run


# -- timing ---------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variant(run: Callable[[], Any], device: torch.device, steps: int) -> dict[str, Any]:
    """Wall ms and process CPU ms per call over `steps` calls (after the caller's warm-up), and
    the peak device memory of the window (CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        run()
    _sync(device)
    out = {
        "wall_ms": (time.perf_counter() - wall) * 1e3 / steps,
        "cpu_ms": (time.process_time() - cpu) * 1e3 / steps,
    }
    if device.type == "cuda":
        out["peak_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def gpu_ms(run: Callable[[], Any], device: torch.device, steps: int) -> float | None:
    """Device time per call: the summed duration of the kernels torch.profiler records over
    `steps` calls (the GPU's busy time, whatever the host does between them); None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        _sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e3 / steps


def measure(
    variants: dict[str, Callable[[], Any]], device: torch.device, steps: int, repeats: int, warmup: int
) -> dict[str, Any]:
    """Interleaved repetitions (rotated order) of every variant: per variant the summaries of its
    wall, CPU and GPU ms per call and its peak memory; a variant that fails (out of memory, a
    compile error) reports its error instead."""
    errors: dict[str, str] = {}
    for name, run in variants.items():  # warm-up (and autotuning) before any timed window
        try:
            for _ in range(warmup):
                run()
            _sync(device)
        except Exception as exc:  # a variant that does not fit must not end the others
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
    live = [name for name in variants if name not in errors]
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in live}
    for rep in range(repeats):
        for name in live[rep % max(len(live), 1) :] + live[: rep % max(len(live), 1)]:
            samples[name].append(time_variant(variants[name], device, steps))
    result: dict[str, Any] = {name: {"error": error} for name, error in errors.items()}
    for name in live:
        rows = samples[name]
        entry = {key: summary([r[key] for r in rows]) for key in rows[0]}
        entry["gpu_ms"] = gpu_ms(variants[name], device, steps)
        result[name] = entry
    return result


def _ratio(results: dict[str, Any], faster: str, baseline: str) -> float | None:
    a, b = results.get(faster, {}), results.get(baseline, {})
    if "wall_ms" not in a or "wall_ms" not in b:
        return None
    return round(b["wall_ms"]["median"] / a["wall_ms"]["median"], 3)


# -- the command ----------------------------------------------------------------------------------


def _load_gr(wanted: bool) -> Any:
    """generative-recommenders' `triton_hstu_mha` (a clone, or the few files of it that
    scripts/gpu_wheels.sh --gr stages, on PYTHONPATH), or None."""
    if not wanted:
        return None
    from generative_recommenders.ops.triton.triton_hstu_attention import triton_hstu_mha

    return triton_hstu_mha


def run_shape(name: str, shape: Shape, args: argparse.Namespace, device: torch.device, gr: Any) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inputs = make_inputs(shape, device, seed=0)
    flops = step_flops(shape, inputs.lengths, inputs.candidates)
    peak, card = peak_tflops(device)
    report: dict[str, Any] = {
        "shape": asdict(shape),
        "tokens": inputs.tokens,
        "step_gflop": round(flops / 1e9, 3),
        "mean_length": round(inputs.tokens / shape.batch, 1),
    }
    if args.only in (None, "attention"):
        variants = attention_variants(shape, inputs, dtype, gr)
        att = measure(variants, device, args.steps, args.repeats, args.warmup)
        att["triton_vs_padded"] = _ratio(att, "triton", "padded")
        att["triton_vs_padded_no_bias"] = _ratio(att, "triton_no_bias", "padded_no_bias")
        att["triton_vs_gr"] = _ratio(att, "triton_no_bias", "gr_triton_no_bias")
        if "wall_ms" in att.get("gr_triton_no_bias", {}) and "wall_ms" in att.get("triton_no_bias", {}):
            att["gr_max_abs_diff"] = _gr_difference(shape, inputs, dtype, gr)
        report["attention"] = att
    if args.only in (None, "step"):
        steps = {a: step_variant(shape, inputs, a, dtype) for a in args.attention}
        measured = measure(steps, device, args.steps, args.repeats, args.warmup)
        for entry in measured.values():
            if "wall_ms" not in entry:
                continue
            seconds = entry["wall_ms"]["median"] / 1e3
            entry["samples_per_s"] = round(shape.batch / seconds, 1)
            entry["tokens_per_s"] = round(inputs.tokens / seconds, 1)
            entry["tflops"] = round(flops / seconds / 1e12, 3)
            entry["mfu"] = None if peak is None else round(flops / seconds / 1e12 / peak, 4)
        measured["triton_vs_padded"] = _ratio(measured, "triton", "padded")
        report["step"] = measured
    report["card"], report["peak_bf16_tflops"] = card, peak
    return report


def _gr_difference(shape: Shape, inputs: Inputs, dtype: torch.dtype, gr: Any) -> float:
    """The largest difference between our attention's output (no bias) and generative-recommenders'
    on the same inputs: both compute SiLU(q k^T) / N under the same mask."""
    from recsys_pipe.models.hstu_triton import jagged_hstu_attention

    gen = torch.Generator(device=inputs.offsets.device).manual_seed(2)
    h, d = shape.heads, shape.width // shape.heads
    q, k, v = (
        torch.randn(inputs.tokens, h, d, device=inputs.offsets.device, dtype=dtype, generator=gen) for _ in "qkv"
    )
    ours = jagged_hstu_attention(q, k, v, inputs.offsets, shape.max_len, inputs.num_candidates)
    theirs = gr(
        N=shape.max_len, alpha=1.0, q=q, k=k, v=v, seq_offsets=inputs.offsets, num_targets=inputs.num_candidates
    )
    return float((ours.float() - theirs.float()).abs().max())


def _fits(shape: Shape, batches: list[int], device: torch.device) -> Shape:
    """The largest batch of `batches` whose triton step runs on the device (DLRMv4's "the batch
    that fits one card")."""
    for batch in sorted(batches, reverse=True):
        candidate = replace(shape, batch=batch)
        try:
            step_variant(candidate, make_inputs(candidate, device, 0), "triton", torch.bfloat16)()
            _sync(device)
            return candidate
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
    return replace(shape, batch=min(batches))


def _print(results: dict[str, Any]) -> None:
    for name, r in results.items():
        print(f"== {name}: {r['tokens']} tokens (mean length {r['mean_length']}), {r['step_gflop']} GFLOP/step")
        for part in ("attention", "step"):
            for variant, entry in r.get(part, {}).items():
                if not isinstance(entry, dict):
                    print(f"   {part} {variant}: {entry}")
                elif "error" in entry:
                    print(f"   {part} {variant}: {entry['error']}")
                else:
                    extra = "".join(
                        f", {key} {entry[key]}" for key in ("samples_per_s", "tflops", "mfu") if key in entry
                    )
                    print(
                        f"   {part} {variant}: wall {format_summary(entry['wall_ms'], ' ms')}, cpu "
                        f"{entry['cpu_ms']['median']} ms, gpu {entry['gpu_ms']} ms, peak "
                        f"{entry.get('peak_allocated_mib', {}).get('median', '-')} MiB{extra}"
                    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="recsys-bench hstu_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)} (default: all)"
    )
    parser.add_argument("--only", choices=["attention", "step"], help="one part (default: both)")
    parser.add_argument("--attention", default="padded,triton", help="the step's model.attention values")
    parser.add_argument(
        "--gr",
        action="store_true",
        help="also time generative-recommenders' Triton attention (put a clone, or wheels/gr, on PYTHONPATH)",
    )
    parser.add_argument("--dlrmv4-batches", default="128,64,32,16,8", help="DLRMv4 batches to try, largest first")
    parser.add_argument("--steps", type=int, default=5, help="calls per timed window")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny shape, 1 repetition (CI, the CPU)")
    args = parser.parse_args(argv)
    args.attention = [a for a in args.attention.split(",") if a]
    device = torch.device(args.device)
    if args.quick:
        shapes = {"quick": QUICK}
        args.steps, args.repeats, args.warmup = 1, 1, 1
    else:
        unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
        if unknown:
            parser.error(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
        shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    from recsys_pipe.models.hstu_attention import uses_triton

    if "triton" in args.attention and not uses_triton("auto", device):
        try:
            from recsys_pipe.models.hstu_triton import runs_on

            usable = runs_on(device)
        except ImportError:
            usable = False
        if not usable:
            args.attention = [a for a in args.attention if a != "triton"]
            print("hstu_gpu: the Triton kernels do not run here (no CUDA, TRITON_INTERPRET unset): padded only")
    gr = _load_gr(args.gr)
    results = {}
    for name, shape in shapes.items():
        if name == "dlrmv4" and device.type == "cuda" and args.only != "attention":
            shape = _fits(shape, [int(b) for b in args.dlrmv4_batches.split(",")], device)
        results[name] = run_shape(name, shape, args, device, gr)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _print(results)
    print(json.dumps({"device": str(device), "shapes": results}, default=_plain))


def _plain(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else str(value)


if __name__ == "__main__":
    main()
