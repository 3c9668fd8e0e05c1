"""`trainer.compile=true` against eager mode: the same run side by side in one process.

Each repetition trains a fresh model eagerly and a fresh model compiled (`trainer.compile=true`,
`--backend`), in an order alternated per repetition, on the same batches: `--warmup` untimed
steps, `--steps` timed steps, then a short tail. Reported: ms/step of each (median (min-max)
over repetitions), the ratio compiled / eager of the paired repetitions (below 1: compiled is
faster), torch.compile's seconds, graphs, graph breaks and recompiles, and how far the compiled
losses stray from the eager ones over every step (max absolute and relative difference).

Checks (exit 1 when one fails): the compiled losses are the same bits in every repetition (on
the CPU), and within `--rtol` / `--atol` of the eager losses at every step
(`torch.testing.assert_close`'s rule). The defaults are the tolerance the docs state.

    recsys-bench compile                       # hstu_small, serial plan, inductor, 200 steps
    recsys-bench compile --steps 50 model.dropout=0.2 pipeline=hstu_prefetch

Run it on an idle machine: the figures of a loaded one say little.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from recsys_pipe.bench.common import format_summary, summary
from recsys_pipe.bench.timing import TAIL, StepTimer, Window
from recsys_pipe.runtime import init_distributed
from recsys_pipe.testing import load_run
from recsys_pipe.train import Trainer, build_parts, training_plan

#: compiled vs eager losses over 200 steps of the default run agree this closely (docs/training.md)
RTOL, ATOL = 1e-5, 1e-6


def train(info: Any, overrides: list[str], warmup: int, steps: int) -> dict[str, Any]:
    """One run: per-step losses, ms/step of the timed window, and (compiled) torch.compile's counts."""
    run = load_run(*overrides)
    plan = training_plan(run)
    trainer = Trainer(build_parts(run, plan, info))
    try:
        first = warmup + plan.task_graph.max_lookahead  # iteration k + L completes step k
        window = Window(info.device)
        trainer.plan_runner.observer = StepTimer(window, first, first + steps)
        losses = trainer.fit(record_steps=True).losses
        compiled = trainer.parts.compiled
        return {
            "losses": losses,
            "ms_per_step": window.figures()["seconds"] * 1000 / steps,
            "compile": compiled.stats().record() if compiled is not None else None,
        }
    finally:
        trainer.close()


def main() -> None:
    """Alternate eager and compiled runs `--reps` times; print the figures, then one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps (and the span of the loss comparison)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation happens here)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--backend", default="inductor", help="trainer.compile_options.backend")
    parser.add_argument("--rtol", type=float, default=RTOL)
    parser.add_argument("--atol", type=float, default=ATOL)
    parser.add_argument("overrides", nargs="*", help="recsys-train overrides (default: the default run, serial plan)")
    args = parser.parse_args()
    if min(args.steps, args.warmup, args.reps, args.threads) < 1:
        parser.error("--steps, --warmup, --reps and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    info = init_distributed("cpu", "gloo")
    total = args.warmup + args.steps + TAIL
    common = [
        "pipeline=serial",
        "trainer.device=cpu",
        "trainer.epochs=1000",  # max_steps decides
        f"trainer.max_steps={total}",
        "trainer.eval_every=0",
        "trainer.progress_bar=false",
        "trainer.tensorboard=false",
        f"trainer.log_every={total + 1}",
        *args.overrides,
    ]
    variants = {
        "eager": common,
        "compiled": [*common, "trainer.compile=true", f"trainer.compile_options.backend={args.backend}"],
    }
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for rep in range(args.reps):
        for name in list(variants)[:: 1 if rep % 2 == 0 else -1]:
            results[name].append(train(info, variants[name], args.warmup, args.steps))
    report, failures = _report(results, args)
    for name in variants:
        print(f"{name:9} {format_summary(report['ms_per_step'][name], ' ms/step')}")
    print(f"compiled / eager: {format_summary(report['ratio_compiled_over_eager'])}")
    print(f"compile: {report['compile']}")
    print(f"losses over {len(results['eager'][0]['losses'])} steps: {report['deviation']}")
    print(json.dumps(report))
    for failure in failures:
        print(f"recsys-bench compile: {failure}", file=sys.stderr)
    if failures:
        raise SystemExit(1)


def _report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The figures, and the checks that failed (one line each)."""
    eager, compiled = results["eager"], results["compiled"]
    ratios = [c["ms_per_step"] / e["ms_per_step"] for c, e in zip(compiled, eager)]
    reference, got = torch.tensor(eager[0]["losses"]), torch.tensor(compiled[0]["losses"])
    difference = (got - reference).abs()
    report = {
        "ms_per_step": {name: summary((r["ms_per_step"] for r in runs), 2) for name, runs in results.items()},
        "ratio_compiled_over_eager": summary(ratios),
        "compile": compiled[0]["compile"],
        "deviation": {
            "max_abs": float(difference.max()),
            "max_rel": float((difference / reference.abs()).max()),
            "rtol": args.rtol,
            "atol": args.atol,
        },
        "backend": args.backend,
        "steps": args.steps,
        "warmup": args.warmup,
        "reps": args.reps,
        "threads": args.threads,
        "overrides": args.overrides,
    }
    failures = []
    if any(r["losses"] != compiled[0]["losses"] for r in compiled[1:]):
        failures.append("the compiled runs trained different bits in different repetitions")
    if any(r["losses"] != eager[0]["losses"] for r in eager[1:]):
        failures.append("the eager runs trained different bits in different repetitions")
    if not torch.allclose(got, reference, rtol=args.rtol, atol=args.atol):
        failures.append(
            f"compiled losses stray from eager beyond rtol={args.rtol}, atol={args.atol}: {report['deviation']}"
        )
    return report, failures


if __name__ == "__main__":
    main()
