"""`recsys-bench raw_ids`: does `ids: managed` pay? Managed-collision tables (each eviction policy)
against `hash` and `modulo`, on one generated stream of raw ids, side by side in one run.

The stream (`Stream`): rows of a label, two dense features, a raw 64-bit `item` id and a small
`context` id. Items are drawn Zipf-skewed (`P(rank k) ∝ k^-zipf`, default 1.1) from `--ids`
distinct raw ids (default 10M); the click depends on the item through a weight per raw id (a
stable hash of the id, standard normal), so a model learns it only as well as the item's row
holds that item alone. Ids arrive over time: the stream is `--phases` phases long, and each
phase the popularity ranks move `--shift` ids along (the phase's top ids include new ones; the
oldest popular ones drop out). The held-out rows are drawn from the last phase, after the
training rows: what the model knows of the ids that are popular now.

Every variant trains DLRM (`data=parquet`, the item table `--rows` rows, default 100k; the same
seed, batches and steps; the serial plan, one rank, one thread) on the training rows in stream
order, then evaluates on the held-out rows. Reported per variant, median (min-max) over
`--reps`: held-out AUC; training samples/s over the timed steps, by the wall clock and by this
process's CPU clock (one thread: on a loaded machine the CPU figure is the steadier one; the
machine's busy share during the window says how loaded it was); and the peak RSS of the run
(`recsys_pipe.bench.timing.PeakMemory`). Then the ratios the targets of docs/raw-ids.md name:
the best managed policy's AUC minus hash's, and each managed policy's samples/s over hash's.

    recsys-bench raw_ids                          # 10M ids, 100k rows, 250 steps of 4096
    recsys-bench raw_ids --quick                  # a small stream: CI runs it
    recsys-bench raw_ids --eviction-interval 1 --reps 3

The figures of a loaded machine say little about speed: run it on an idle one.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recsys_pipe.bench.common import format_summary, summary
from recsys_pipe.bench.timing import TAIL, PeakMemory, StepTimer, Window
from recsys_pipe.data.ids import EVICTION_POLICIES, splitmix64

__all__ = ["Stream", "VARIANTS", "main", "variant_overrides"]

#: the variants: `managed/<policy>` for each eviction policy, then the two fixed mappings
VARIANTS = (*(f"managed/{p}" for p in EVICTION_POLICIES), "hash", "modulo")
#: raw ids are 63-bit (every non-negative int64 but the largest): the default raw id space
_ID_SPACE = 2**63 - 1
_CONTEXTS = 64


@dataclass(frozen=True)
class Stream:
    """The generated stream's shape (module docstring)."""

    ids: int
    zipf: float
    phases: int
    shift: int
    seed: int

    def items(self, n: int, phase: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """`n` raw item ids, the i-th of phase `phase[i]`: a Zipf rank (truncated to `ids`) moved
        `phase * shift` along the ids, as a raw 63-bit id (SplitMix64 of its index)."""
        ranks = np.empty(n, dtype=np.int64)
        todo = np.arange(n)
        while todo.size:  # numpy's Zipf is unbounded: ranks past `ids` are drawn again
            drawn = rng.zipf(self.zipf, todo.size)
            kept = drawn <= self.ids
            ranks[todo[kept]] = drawn[kept] - 1
            todo = todo[~kept]
        index = (ranks + phase * self.shift) % self.ids
        return (splitmix64(index) % np.uint64(_ID_SPACE)).astype(np.int64)

    def rows(self, n: int, first_phase: float, last_phase: float, salt: int) -> pa.Table:
        """`n` rows whose phases run evenly from `first_phase` to `last_phase` (stream order)."""
        rng = np.random.default_rng([self.seed, salt])
        phase = np.minimum(np.floor(np.linspace(first_phase, last_phase, n, endpoint=False)), self.phases - 1)
        items = self.items(n, phase.astype(np.int64), rng)
        context = rng.integers(0, _CONTEXTS, n)
        dense = rng.normal(size=(n, 2)).astype(np.float32)
        context_weight = np.random.default_rng([self.seed, 1]).normal(size=_CONTEXTS)
        logit = 2.0 * _item_weight(items) + 0.5 * context_weight[context] + 0.3 * dense[:, 0] - 0.5
        label = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return pa.table({"label": label, "d0": dense[:, 0], "d1": dense[:, 1], "item": items, "context": context})


def _item_weight(items: np.ndarray) -> np.ndarray:
    """A standard normal weight per raw id (Box-Muller over two stable 53-bit uniforms of it)."""
    u = [(splitmix64(items, seed) >> np.uint64(11)).astype(np.float64) / 2**53 for seed in (1, 2)]
    return np.sqrt(-2.0 * np.log(np.maximum(u[0], 2**-53))) * np.cos(2.0 * math.pi * u[1])


def variant_overrides(variant: str, rows: int, eviction_interval: int) -> list[str]:
    """The data columns of `variant`: the item table's id mapping (managed: with its policy)."""
    mapping, _, policy = variant.partition("/")
    managed = f",managed:{{eviction_policy:{policy},eviction_interval:{eviction_interval}}}" if policy else ""
    item = f"{{num_embeddings:{rows},ids:{mapping}{managed}}}"
    context = f"{{num_embeddings:{_CONTEXTS},ids:as_is}}"
    return [f"data.columns={{labels:[label],dense:[d0,d1],sparse:{{item:{item},context:{context}}}}}"]


def _train(info: Any, overrides: list[str], warmup: int, steps: int) -> dict[str, Any]:
    """One run of `overrides`: held-out AUC after training, samples/s of the timed steps, peak RSS."""
    from recsys_pipe.testing import load_run
    from recsys_pipe.train import Trainer, build_parts, training_plan

    memory = PeakMemory(info.device)
    memory.start()
    run = load_run(*overrides)
    plan = training_plan(run)
    trainer = Trainer(build_parts(run, plan, info))
    try:
        window = Window(info.device)
        trainer.plan_runner.observer = StepTimer(window, warmup, warmup + steps)
        trainer.fit()
        auc = float(trainer.evaluate()["auc"])
        timed = window.figures()
        samples = steps * run.data.batch_size
        return {
            "auc": auc,
            "samples_per_s": samples / timed["seconds"],
            "samples_per_cpu_s": samples / timed["cpu_seconds"],
            "machine_busy": timed["machine_busy"],
            **memory.stop(),
        }
    finally:
        trainer.close()


#: the sizes of a run, and of `--quick` (an option given on the command line wins over both)
SIZES = {"ids": 10_000_000, "rows": 100_000, "steps": 250, "batch": 4096, "eval_rows": 50_000, "eviction_interval": 10}
QUICK = {"ids": 20_000, "rows": 1_000, "steps": 40, "batch": 128, "eval_rows": 4_000, "eviction_interval": 4}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a small stream (CI): {QUICK}")
    parser.add_argument("--ids", type=int, help=f"distinct raw item ids ({SIZES['ids']:,})")
    parser.add_argument("--rows", type=int, help=f"rows of the item table ({SIZES['rows']:,})")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of item popularity")
    parser.add_argument("--phases", type=int, default=4, help="phases of the stream (popular ids move each)")
    parser.add_argument("--shift", type=int, default=None, help="ids the ranks move per phase (default: rows / 2)")
    parser.add_argument("--steps", type=int, help=f"training steps ({SIZES['steps']})")
    parser.add_argument("--batch", type=int, help=f"rows per step ({SIZES['batch']})")
    parser.add_argument("--eval-rows", type=int, help=f"held-out rows of the last phase ({SIZES['eval_rows']:,})")
    parser.add_argument(
        "--eviction-interval",
        type=int,
        help=f"data.columns.sparse.item.managed's ({SIZES['eviction_interval']}; docs/raw-ids.md)",
    )
    parser.add_argument("--reps", type=int, default=1, help="runs of each variant")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="recsys-train overrides after the benchmark's")
    return parser


def _arguments(argv: list[str] | None = None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    for key, value in (QUICK if args.quick else SIZES).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.shift = args.rows // 2 if args.shift is None else args.shift
    return args


def _write_stream(args: argparse.Namespace, directory: Path) -> None:
    """The training rows (every phase, stream order) and the held-out rows (the last phase)."""
    stream = Stream(args.ids, args.zipf, args.phases, args.shift, args.seed)
    pq.write_table(stream.rows(args.steps * args.batch, 0, args.phases, salt=2), directory / "train.parquet")
    pq.write_table(stream.rows(args.eval_rows, args.phases - 1, args.phases, salt=3), directory / "eval.parquet")


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """Write the stream into `directory`, train every variant `args.reps` times (alternating the
    order per repetition); the report (module docstring)."""
    from recsys_pipe.runtime import init_distributed

    _write_stream(args, directory)
    info = init_distributed("cpu", "gloo")
    warmup = min(10, max(1, args.steps // 10))
    eval_batches = max(1, args.eval_rows // args.batch)
    common = [
        "model=dlrm",
        "model.sharding=row_wise",
        "model.dense_arch_layer_sizes=[32,16]",
        "pipeline=serial",
        "data=parquet",
        f"data.path={directory / 'train.parquet'}",
        f"data.eval_path={directory / 'eval.parquet'}",
        f"data.batch_size={args.batch}",
        f"trainer.max_steps={args.steps}",
        "trainer.eval_every=0",
        f"trainer.eval_batches={eval_batches}",
        "trainer.progress_bar=false",
        "trainer.tensorboard=false",
        f"trainer.log_every={args.steps + 1}",
        f"seed={args.seed}",
        *args.overrides,
    ]
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    timed = args.steps - warmup - TAIL
    for rep in range(args.reps):
        for variant in args.variants[:: 1 if rep % 2 == 0 else -1]:
            overrides = [*common, *variant_overrides(variant, args.rows, args.eviction_interval)]
            results[variant].append(_train(info, overrides, warmup, timed))
    return _report(args, results)


def _report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    digits = {"auc": 4, "samples_per_s": 0, "samples_per_cpu_s": 0, "peak_rss_mib": 1, "machine_busy": 2}
    figures = {
        variant: {
            key: summary([r[key] for r in runs], places)
            for key, places in digits.items()
            if all(r.get(key) is not None for r in runs)
        }
        for variant, runs in results.items()
    }
    report: dict[str, Any] = {
        "stream": {
            "ids": args.ids,
            "zipf": args.zipf,
            "phases": args.phases,
            "shift": args.shift,
            "train_rows": args.steps * args.batch,
            "eval_rows": args.eval_rows,
        },
        "rows": args.rows,
        "steps": args.steps,
        "batch": args.batch,
        "eviction_interval": args.eviction_interval,
        "reps": args.reps,
        "variants": figures,
    }
    managed = [v for v in figures if v.startswith("managed/")]
    if managed and "hash" in figures:
        best = max(managed, key=lambda v: figures[v]["auc"]["median"])
        report["targets"] = {
            "best_managed": best,
            "auc_best_managed_minus_hash": figures[best]["auc"]["median"] - figures["hash"]["auc"]["median"],
            **{
                f"{key}_over_hash": {v: figures[v][key]["median"] / figures["hash"][key]["median"] for v in managed}
                for key in ("samples_per_s", "samples_per_cpu_s")
            },
        }
    return report


def _print(report: dict[str, Any]) -> None:
    s = report["stream"]
    print(
        f"stream: {s['ids']:,} raw ids, Zipf {s['zipf']}, {s['phases']} phases (+{s['shift']:,} ids each), "
        f"{s['train_rows']:,} training rows, {s['eval_rows']:,} held-out rows of the last phase; item table "
        f"{report['rows']:,} rows; {report['steps']} steps of {report['batch']}; eviction_interval "
        f"{report['eviction_interval']}; {report['reps']} rep(s)"
    )
    columns = ("held-out AUC", "samples/s", "samples/CPU-s", "peak RSS MiB", "machine busy")
    print(f"{'variant':21}" + "".join(f"{c:>26}" for c in columns))
    for variant, f in report["variants"].items():
        keys = ("auc", "samples_per_s", "samples_per_cpu_s", "peak_rss_mib", "machine_busy")
        cells = [format_summary(f[k]) if k in f else "not measured" for k in keys]
        print(f"{variant:21}" + "".join(f"{c:>26}" for c in cells))
    targets = report.get("targets")
    if targets:
        print(f"AUC, best managed ({targets['best_managed']}) - hash: {targets['auc_best_managed_minus_hash']:+.4f}")
        for variant, ratio in targets["samples_per_s_over_hash"].items():
            cpu = targets["samples_per_cpu_s_over_hash"][variant]
            print(f"{variant} / hash: samples/s {ratio:.2f}x, samples/CPU-s {cpu:.2f}x")
    print(json.dumps(report))


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark (module docstring); print the table, then one JSON line."""
    args = _arguments(argv)
    if min(args.ids, args.rows, args.steps, args.batch, args.eval_rows, args.reps, args.phases) < 1:
        raise SystemExit("recsys-bench raw_ids: sizes, steps and reps must be >= 1")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        _print(run(args, Path(scratch)))


if __name__ == "__main__":
    main()
