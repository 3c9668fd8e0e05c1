"""The balanced batch shuffler on Zipf-distributed sequence lengths: per-rank imbalance before and
after, and training throughput of the balanced plans against the same plans without it.

Data: synthetic HSTU sequences with `data.synthetic.length_distribution=zipf` (mostly short
sequences, a heavy tail of long ones). Every variant trains the same pre-built batches (each
rank's loader share) from the same seed:

  hstu_sparse_dist            the baseline: each rank trains its batches as loaded
  hstu_sparse_dist_balanced   + start_shuffle / finish_shuffle (Karmarkar-Karp over ranks)
  hstu_prefetch, hstu_prefetch_balanced   the same pair with embedding prefetch

Imbalance (no timing involved): for every batch, the per-rank sums of the model's workload
(`HSTUConfig.sample_costs`: `layers * (4 n^2 d + 10 n d^2)` per sample of n tokens) and of the
tokens, as max over ranks / mean over ranks, before (as loaded) and after the partition the
shuffler applies (`solve_shuffle`, the same function the tasks run); reported as the mean over
batches and the worst batch.

Throughput: each repetition runs every variant once, the order rotating per repetition; a fresh
trainer, `--warmup` untimed steps, a barrier, `--steps` timed steps (time = max over ranks), then
tail steps so the window is steady state. samples/s = batch * world * steps / seconds; reported:
the median over repetitions and the min..max, and the ratio of medians balanced / unbalanced.
Each variant must train bitwise the same losses in every repetition (asserted), and a balanced
plan must train, per step, exactly the samples loaded over all ranks (asserted).

Note for reading the CPU figures: this repository's CPU HSTU pads attention to `max_seq_len`, so
on the CPU only the token-proportional work (projections, norms, MLP, embedding traffic) depends
on the lengths; the quadratic workload model describes jagged attention kernels (the GPU case).

Run (2 gloo ranks on the CPU; without torchrun the module re-executes itself under it):

    recsys-bench shuffle [--steps N] [--repeats R] [--batch-size B] [--max-seq-len L]
    python -m recsys_pipe.bench.shuffle ...    # the same, without the console script

Rank 0 prints a table and, last, one JSON line with all figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch
import torch.distributed as dist

from recsys_pipe.bench.common import one_thread_per_rank, reexec_under_torchrun, run_ranks
from recsys_pipe.bench.timing import TAIL, StepTimer, Window

NPROC = 2
PAIRS = (("hstu_sparse_dist", "hstu_sparse_dist_balanced"), ("hstu_prefetch", "hstu_prefetch_balanced"))
VARIANTS = tuple(v for pair in PAIRS for v in pair)


def run_config(plan: str, args: argparse.Namespace, num_batches: int) -> Any:
    """The run config of `plan` on the Zipf-length synthetic data of the command line."""
    from recsys_pipe.testing import load_run

    return load_run(
        f"pipeline={plan}",
        "trainer.progress_bar=false",
        "trainer.eval_every=0",
        "trainer.eval_batches=0",
        "trainer.max_steps=null",
        "trainer.device=cpu",
        "trainer.backend=gloo",
        f"trainer.log_every={num_batches + 1}",
        f"data.batch_size={args.batch_size}",
        f"data.num_batches={num_batches}",
        f"data.max_seq_len={args.max_seq_len}",
        f"model.max_seq_len={args.max_seq_len}",
        f"model.embedding_dim={args.embedding_dim}",
        "data.synthetic.length_distribution=zipf",
        f"data.synthetic.zipf_alpha={args.alpha}",
        f"data.synthetic.min_seq_len={args.min_seq_len}",
    )


def imbalance(run: Any, batches: list, world: int) -> dict[str, dict[str, float]]:
    """Per-rank workload and token imbalance of every batch, as loaded and after the partition."""
    from recsys_pipe.train.shuffle import solve_shuffle

    local = [(run.model.sample_costs(b).tolist(), b.sequence_lengths().tolist()) for b in batches]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, local)
    out: dict[str, list[float]] = {"workload_before": [], "workload_after": [], "tokens_before": [], "tokens_after": []}
    for step in range(len(batches)):
        costs = [c for rank in everyone for c in rank[step][0]]
        tokens = [n for rank in everyone for n in rank[step][1]]
        plan = solve_shuffle(costs, world)
        size = len(costs) // world
        before = [sum(tokens[r * size : (r + 1) * size]) for r in range(world)]
        after = [sum(tokens[i] for i in part) for part in plan.positions]
        out["workload_before"].append(plan.imbalance_before)
        out["workload_after"].append(plan.imbalance_after)
        out["tokens_before"].append(max(before) / (sum(before) / world))
        out["tokens_after"].append(max(after) / (sum(after) / world))
    return {k: {"mean": statistics.fmean(v), "worst": max(v)} for k, v in out.items()}


def train(run: Any, info: Any, batches: list, warmup: int, steps: int) -> tuple[float, list[float], list]:
    """Seconds of the timed window (this rank), per-step losses, per-step trained sample ids."""
    from recsys_pipe.train import Trainer, build_parts, training_plan

    plan = training_plan(run)
    trainer = Trainer(build_parts(run, plan, info))
    try:
        window = Window(info.device)
        first = warmup + plan.task_graph.max_lookahead  # iteration k + L completes step k
        trainer.plan_runner.observer = StepTimer(window, first, first + steps)
        summary = trainer.fit(batches=iter(batches), record_steps=True)
        assert summary.steps == len(batches), (summary.steps, len(batches))
        return window.figures()["seconds"], summary.losses, [ids.tolist() for ids in summary.sample_ids]
    finally:
        trainer.close()


def max_over_ranks(value: float) -> float:
    """The largest `value` over all ranks."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before the window (default 5)")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions of every variant (default 5)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size (default 32)")
    parser.add_argument("--max-seq-len", type=int, default=64, help="longest sequence (default 64)")
    parser.add_argument("--min-seq-len", type=int, default=8, help="shortest sequence (default 8)")
    parser.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent of the lengths (default 1.2)")
    parser.add_argument("--embedding-dim", type=int, default=64, help="HSTU width (default 64)")
    args = parser.parse_args()
    if min(args.steps, args.repeats, args.warmup, args.batch_size) < 1:
        parser.error("--steps, --repeats, --warmup and --batch-size must be >= 1")
    return args


def main() -> None:
    """Measure imbalance, then train every variant in interleaved repetitions; rank 0 prints the report."""
    args = parse_args()
    one_thread_per_rank()
    from recsys_pipe.data import make_dataloader
    from recsys_pipe.runtime import init_distributed

    info = init_distributed("cpu", "gloo")
    world, main_rank = info.world_size, info.rank == 0
    total = args.warmup + args.steps + TAIL
    runs = {v: run_config(v, args, total) for v in VARIANTS}
    batches = list(make_dataloader(runs[VARIANTS[0]].data, info.rank, world))  # loading is not timed
    balance = imbalance(runs[VARIANTS[0]], batches, world)
    if main_rank:
        print(
            f"bench_shuffle: {world} ranks (gloo, CPU, 1 intra-op thread each), batch {args.batch_size}/rank, "
            f"Zipf lengths {args.min_seq_len}..{args.max_seq_len} (alpha {args.alpha}), HSTU width "
            f"{args.embedding_dim}; {args.warmup} warm-up + {args.steps} timed + {TAIL} tail steps, "
            f"{args.repeats} repetition(s)",
            flush=True,
        )
    seconds = train_every_variant(runs, info, batches, args, total)
    if main_rank:
        report(seconds, balance, args, world)


def train_every_variant(
    runs: dict[str, Any], info: Any, batches: list, args: argparse.Namespace, total: int
) -> dict[str, list[float]]:
    """Every variant trained `args.repeats` times, interleaved, on the same batches: the timed
    window's seconds (the slowest rank) per repetition. Asserts that each balanced step trained
    exactly the samples loaded over all ranks, and that repetitions train the same losses."""
    world = info.world_size
    loaded = [b.sample_ids.tolist() for b in batches]
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    losses: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]
        for name in order:
            window_seconds, step_losses, trained = train(runs[name], info, batches, args.warmup, args.steps)
            seconds[name].append(max_over_ranks(window_seconds))
            losses[name].append(step_losses)
            if name.endswith("_balanced"):  # every loaded sample trained once over all ranks, per step
                both: list[Any] = [None] * world
                dist.all_gather_object(both, (trained, loaded))
                for step in range(total):
                    got = sorted(i for rank_trained, _ in both for i in rank_trained[step])
                    want = sorted(i for _, rank_loaded in both for i in rank_loaded[step])
                    assert got == want, f"{name}: step {step} trained other samples than were loaded"
        if info.rank == 0:
            print(
                f"  repetition {rep + 1}/{args.repeats}: "
                + ", ".join(f"{v} {args.batch_size * world * args.steps / seconds[v][-1]:.0f}" for v in VARIANTS)
                + " samples/s",
                flush=True,
            )
    for name in VARIANTS:  # deterministic: every repetition trains the same losses
        if not all(got == losses[name][0] for got in losses[name]):
            raise AssertionError(f"rank {info.rank}: {name} trained different losses in different repetitions")
    return seconds


def report(
    seconds: dict[str, list[float]], balance: dict[str, dict[str, float]], args: argparse.Namespace, world: int
) -> None:
    """Print the imbalance, every variant's speed (median, min..max) and its ratio to the
    unbalanced plan, then the whole as one JSON line."""
    samples = args.batch_size * world * args.steps
    sps = {v: statistics.median(samples / s for s in seconds[v]) for v in VARIANTS}
    spread = {v: (min(samples / s for s in seconds[v]), max(samples / s for s in seconds[v])) for v in VARIANTS}
    ratio = {balanced: sps[balanced] / sps[plain] for plain, balanced in PAIRS}
    print()
    print("per-rank imbalance, max over ranks / mean over ranks (mean over batches, worst batch):")
    for measure in ("workload", "tokens"):
        b, a = balance[f"{measure}_before"], balance[f"{measure}_after"]
        print(
            f"  {measure:<9} as loaded {b['mean']:.3f} (worst {b['worst']:.3f})   "
            f"balanced {a['mean']:.3f} (worst {a['worst']:.3f})"
        )
    print()
    print(f"{'variant':<27} {'samples/s':>10} {'(min..max)':>16} {'ms/step':>8} {'vs unbalanced':>14}")
    for v in VARIANTS:
        lo, hi = spread[v]
        print(
            f"{v:<27} {sps[v]:>10.1f} {f'({lo:.0f}..{hi:.0f})':>16} {samples / sps[v] / args.steps * 1e3:>8.2f} "
            f"{(f'{ratio[v]:.3f}x' if v in ratio else '-'):>14}"
        )
    print("each balanced step trained exactly the samples loaded over all ranks: yes", flush=True)
    print(
        json.dumps(
            {
                "imbalance": {k: {s: round(x, 4) for s, x in v.items()} for k, v in balance.items()},
                "samples_per_s": {v: round(sps[v], 2) for v in VARIANTS},
                "samples_per_s_range": {v: [round(x, 2) for x in spread[v]] for v in VARIANTS},
                "ratio_balanced_vs_unbalanced": {v: round(r, 4) for v, r in ratio.items()},
                "steps": args.steps,
                "repeats": args.repeats,
                "world_size": world,
                "batch_size": args.batch_size,
                "max_seq_len": args.max_seq_len,
                "alpha": args.alpha,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    reexec_under_torchrun(__spec__.name, NPROC)  # plain `python -m recsys_pipe.bench.shuffle`: 2 ranks
    run_ranks(main)
