"""The attention bias's table lookup, forward and backward: plain indexing against
`recsys_pipe.models.hstu.SummedBackwardLookup` (what `bias_lookup` uses on CUDA) and the
embedding lookup (`F.embedding`, another backward that splits duplicates).

An HSTU layer adds `time[bucket]` to every (query, key) of every sample: B*N*N reads of a table of
`num_time_buckets + 1` entries, whose gradient sums all those positions into the few entries the
gaps fall in. The buckets here are those of `RelativeBias.bucketize` on timestamps a day to a year
apart (most in the last bucket, as real gaps are). Each variant runs forward and backward `--iters`
times per repetition; the table prints ms per call, medians (min-max) over `--repeats`
interleaved repetitions, the ratio against indexing, and each variant's largest relative error of
the gradient against the exact sums (float64 on the CPU). It exits 1 if the lookup the model uses
(`summed_backward`) is off by more than 1e-4: float32 sums of millions of terms differ by ~1e-5.

    recsys-bench bias_lookup                # CUDA if there is one, else the CPU
    recsys-bench bias_lookup --batch 1024 --length 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from recsys_pipe.models.hstu import RelativeBias, SummedBackwardLookup

#: the largest relative error of the gradient `summed_backward` may have against the exact sums
TOLERANCE = 1e-4
VARIANTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "indexing": lambda table, index: table[index],
    "summed_backward": SummedBackwardLookup.apply,
    "embedding": lambda table, index: F.embedding(index, table.unsqueeze(1)).squeeze(-1),
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="recsys-bench bias_lookup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--length", type=int, default=64, help="padded sequence length N")
    parser.add_argument("--buckets", type=int, default=32, help="num_time_buckets")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    bias = RelativeBias(args.length, args.buckets).to(device)
    times = torch.randint(86_400, 365 * 86_400, (args.batch, args.length), generator=gen).cumsum(1).to(device)
    index = bias.bucketize(times)
    grad = torch.randn(index.shape, generator=gen).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def once(name: str) -> torch.Tensor:
        table = bias.time.detach().clone().requires_grad_(True)
        VARIANTS[name](table, index).backward(grad)
        return table.grad

    exact = torch.zeros(args.buckets + 1, dtype=torch.float64)
    exact.index_put_((index.reshape(-1).cpu(),), grad.reshape(-1).double().cpu(), accumulate=True)
    scale = exact.abs().clamp(min=1.0)
    error = {name: float(((once(name).double().cpu() - exact).abs() / scale).max()) for name in VARIANTS}
    ms: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for name in VARIANTS:
        once(name)  # warm-up
    for _ in range(args.repeats):
        for name in VARIANTS:
            sync()
            start = time.perf_counter()
            for _ in range(args.iters):
                once(name)
            sync()
            ms[name].append((time.perf_counter() - start) / args.iters * 1e3)
    share = torch.bincount(index.reshape(-1), minlength=args.buckets + 1).max().item() / index.numel()
    print(
        f"bias lookup on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}: "
        f"{index.numel():,} reads of {args.buckets + 1} entries (batch {args.batch}, N {args.length}; "
        f"{share:.0%} in the fullest), forward + backward, ms per call over {args.repeats} repetitions"
    )
    base = statistics.median(ms["indexing"])
    rows = {}
    for name, values in ms.items():
        med = statistics.median(values)
        rows[name] = {"ms": med, "min": min(values), "max": max(values), "vs_indexing": base / med}
        rows[name]["grad_relative_error"] = error[name]
        print(
            f"  {name:16s} {med:9.3f} ms ({min(values):.3f}-{max(values):.3f})  "
            f"{base / med:7.2f}x indexing  gradient relative error {error[name]:.1e}"
        )
    print(json.dumps({"device": str(device), "reads": index.numel(), "fullest_share": share, "variants": rows}))
    if error["summed_backward"] > TOLERANCE:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
