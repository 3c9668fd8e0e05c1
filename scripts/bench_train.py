#!/usr/bin/env python
"""Training throughput of the shipped plans against torchrec's own pipeline, side by side.

Variants, trained on the same model (same seed) and the same pre-materialised batches:

  serial            pipeline=serial            (every task at lookahead 0, sequential executor)
  hstu_sparse_dist  pipeline=hstu_sparse_dist  (h2d 2 ahead, input dist 1 ahead, threaded)
  hstu_prefetch     pipeline=hstu_prefetch     (+ prefetch_embeddings 1 ahead, threaded)
  torchrec_sdd      torchrec's TrainPipelineSparseDist with custom_model_fwd

Each repetition runs every variant once (the order rotates per repetition so no variant always
goes first): a fresh model, `--warmup` untimed steps, a barrier, then `--steps` timed steps; the
time of a variant is the max over ranks (all_reduce MAX). After the timed window the pipelines
still run `TAIL` steps (untimed) so the window is steady state, not the drain. samples/s =
batch_size * world_size * steps / seconds; the figure reported is the median over repetitions,
ratios are ratios of those medians. "CPU ms/step" is the process CPU time (all threads, gloo's
included) over the window, max over ranks: when it is close to ms/step the ranks saturate the
cores and there is nothing left for a pipeline to overlap with. Per-step losses of every variant
and repetition must be bitwise equal (asserted): otherwise the variants would not be computing
the same thing.

Engine share (one extra, instrumented run per engine plan; throughput runs are not
instrumented): every task body (`FnTask.run`) is timed per CPU thread; over the timed window

    engine share = (time inside progress() - task-body time of the busiest thread) / time inside progress()

i.e. what the engine itself costs on the critical path (event waits, firing, context objects,
thread hand-offs and waiting for workers), not the task functions. For the sequential executor
that is (wall - sum of task time) / wall.

Run (2 gloo ranks on the CPU; without torchrun the script re-executes itself under it):

    .venv/bin/python scripts/bench_train.py [--steps N] [--repeats R] [--batch-size B]
    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/bench_train.py [...]

Rank 0 prints a table and, last, one JSON line with all figures.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NPROC = 2

if __name__ == "__main__" and "LOCAL_RANK" not in os.environ:
    # Plain `python scripts/bench_train.py`: re-execute under torchrun with 2 ranks.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.execv(
        sys.executable,
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(NPROC),
            os.path.abspath(__file__),
            *sys.argv[1:],
        ],
    )

os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads its OpenMP runtime
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ENGINE_PLANS = ("serial", "hstu_sparse_dist", "hstu_prefetch")
PIPELINED = ("hstu_sparse_dist", "hstu_prefetch")
TORCHREC = "torchrec_sdd"
VARIANTS = (*ENGINE_PLANS, TORCHREC)
TAIL = 2  # untimed steps after the window: the max lookahead, so the window never drains


# -- timing ---------------------------------------------------------------------------------------


class TaskTimer:
    """Accumulates task-body time per CPU thread by wrapping `FnTask.run` (instrumented runs only)."""

    def __init__(self) -> None:
        self.active = False
        self.per_thread: dict[str, float] = {}
        self.per_task: dict[str, float] = {}

    def reset(self) -> None:
        self.per_thread = {}
        self.per_task = {}

    def install(self) -> Callable[[], None]:
        from recsys_pipe.engine.task import FnTask

        original = FnTask.run
        timer = self

        def timed_run(task: Any, ctx: Any) -> None:
            if not timer.active:
                return original(task, ctx)
            start = time.perf_counter()
            try:
                return original(task, ctx)
            finally:
                spent = time.perf_counter() - start
                name = threading.current_thread().name  # one key per thread: no lock needed
                timer.per_thread[name] = timer.per_thread.get(name, 0.0) + spent
                timer.per_task[task.name] = timer.per_task.get(task.name, 0.0) + spent  # one writer per task

        FnTask.run = timed_run

        def uninstall() -> None:
            FnTask.run = original

        return uninstall


class Window:
    """Wraps a `progress(it)` callable: times steps [warmup, warmup + steps) after a barrier,
    records every step's loss tensor, optionally times the task bodies in the window."""

    def __init__(
        self,
        progress: Callable[[Any], Any],
        loss_of: Callable[[Any], torch.Tensor],
        warmup: int,
        steps: int,
        timer: TaskTimer | None = None,
    ):
        self.progress, self.loss_of = progress, loss_of
        self.warmup, self.steps = warmup, steps
        self.timer = timer
        self.done = 0
        self.losses: list[torch.Tensor] = []
        self.start = self.end = None
        self.cpu_start = self.cpu_end = 0.0  # this process's CPU time, all threads (gloo's included)
        self.in_progress = 0.0  # seconds spent inside progress() during the window

    def __call__(self, it: Any) -> Any:
        timed = self.warmup <= self.done < self.warmup + self.steps
        if self.done == self.warmup:
            dist.barrier()
            if self.timer is not None:
                self.timer.reset()
                self.timer.active = True
            self.cpu_start = time.process_time()
            self.start = time.perf_counter()
        before = time.perf_counter()
        result = self.progress(it)  # StopIteration propagates to the caller's loop
        after = time.perf_counter()
        if timed:
            self.in_progress += after - before
        self.done += 1
        if self.done == self.warmup + self.steps:
            self.end = after
            self.cpu_end = time.process_time()
            if self.timer is not None:
                self.timer.active = False
        self.losses.append(self.loss_of(result).detach().clone())
        return result

    @property
    def cpu_seconds(self) -> float:
        return self.cpu_end - self.cpu_start

    @property
    def seconds(self) -> float:
        if self.end is None:
            raise RuntimeError(f"only {self.done} steps ran; the window needs {self.warmup + self.steps}")
        return self.end - self.start


# -- variants -------------------------------------------------------------------------------------


def run_config(plan: str, batch_size: int, num_batches: int, extra: tuple[str, ...] = ()) -> Any:
    from recsys_pipe.testing import load_run

    overrides = [
        f"pipeline={plan}",
        "trainer.progress_bar=false",
        "trainer.eval_every=0",
        "trainer.eval_batches=0",
        "trainer.max_steps=null",
        "trainer.device=cpu",
        "trainer.backend=gloo",
        f"trainer.log_every={num_batches + 1}",  # no metrics all-reduce inside the timed window
        f"data.batch_size={batch_size}",
        f"data.num_batches={num_batches}",
        *extra,
    ]
    return load_run(*overrides)


def run_engine_plan(run: Any, info: Any, batches: list, make_window: Callable[..., Window]) -> Window:
    from recsys_pipe.train import Trainer, training_plan

    trainer = Trainer(run, training_plan(run), info)
    try:
        window = make_window(trainer.pipeline.progress, lambda result: result.loss)
        trainer.pipeline.progress = window  # instance attribute: fit() calls it per step
        summary = trainer.fit(batches=iter(batches))
        assert summary.steps == len(batches), (summary.steps, len(batches))
        return window
    finally:
        trainer.close()


def run_torchrec(run: Any, info: Any, batches: list, make_window: Callable[..., Window]) -> Window:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recsys_pipe.train import build_model

    spec = _spec(run, info)
    model, opt = build_model(run, info, spec)

    def fwd(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        loss, _ = model(batch)
        return loss, loss.detach()

    pipe = TrainPipelineSparseDist(model, opt, info.device, execute_all_batches=True, custom_model_fwd=fwd)
    window = make_window(pipe.progress, lambda loss: loss)
    it = iter(batches)
    steps = 0
    while True:
        try:
            window(it)
        except StopIteration:
            break
        steps += 1
    assert steps == len(batches), (steps, len(batches))
    return window


_SPECS: dict = {}


def _spec(run: Any, info: Any) -> Any:
    from recsys_pipe.data import make_dataloader

    if "spec" not in _SPECS:
        _SPECS["spec"] = make_dataloader(run.data, info.rank, info.world_size).dataset.spec
    return _SPECS["spec"]


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per run (default 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before the window (default 5)")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions of every variant (default 5)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size (default 32)")
    parser.add_argument("--no-engine-share", action="store_true", help="skip the instrumented engine-share runs")
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1 or args.warmup < 1 or args.batch_size < 1:
        parser.error("--steps, --repeats, --warmup and --batch-size must be >= 1")

    torch.set_num_threads(1)
    from recsys_pipe.data import make_dataloader
    from recsys_pipe.train import init_distributed

    info = init_distributed("cpu", "gloo")
    rank, world = info.rank, info.world_size
    main_rank = rank == 0
    total = args.warmup + args.steps + TAIL
    runs = {plan: run_config(plan, args.batch_size, total) for plan in ENGINE_PLANS}
    runs[TORCHREC] = runs["serial"]  # build_model reads model/optimizer/seed, identical in every plan
    batches = list(make_dataloader(runs["serial"].data, rank, world))  # data loading is not timed
    assert len(batches) == total, (len(batches), total)

    def make_window(timer: TaskTimer | None = None):
        return lambda progress, loss_of: Window(progress, loss_of, args.warmup, args.steps, timer)

    def run_variant(name: str, window_factory: Callable[..., Window]) -> Window:
        runner = run_torchrec if name == TORCHREC else run_engine_plan
        return runner(runs[name], info, batches, window_factory)

    if main_rank:
        print(
            f"bench_train: {world} ranks (gloo, CPU, 1 intra-op thread each), batch {args.batch_size}/rank, "
            f"{args.warmup} warm-up + {args.steps} timed + {TAIL} tail steps, {args.repeats} repetition(s)",
            flush=True,
        )
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}  # CPU seconds of the window, max over ranks
    losses: dict[str, list[torch.Tensor]] = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]
        for name in order:
            window = run_variant(name, make_window())
            seconds[name].append(max_over_ranks(window.seconds))
            cpu[name].append(max_over_ranks(window.cpu_seconds))
            losses[name].append(torch.stack(window.losses))
        if main_rank:
            print(
                f"  repetition {rep + 1}/{args.repeats}: "
                + ", ".join(f"{v} {args.batch_size * world * args.steps / seconds[v][-1]:.0f}" for v in VARIANTS)
                + " samples/s",
                flush=True,
            )

    # Same computation: every variant, every repetition, bitwise-equal per-step losses.
    reference = losses["serial"][0]
    mismatches = [
        f"{v}[rep {r}]" for v in VARIANTS for r, got in enumerate(losses[v]) if not torch.equal(got, reference)
    ]
    ok = torch.tensor([0 if mismatches else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        raise AssertionError(
            f"rank {rank}: per-step losses differ from serial for {mismatches or 'another rank'}; "
            "the variants do not compute the same thing"
        )

    # Engine share: one instrumented run per engine plan.
    engine: dict[str, dict[str, float]] = {}
    if not args.no_engine_share:
        timer = TaskTimer()
        uninstall = timer.install()
        try:
            for plan in ENGINE_PLANS:
                window = run_variant(plan, make_window(timer))
                if not torch.equal(torch.stack(window.losses), reference):
                    raise AssertionError(f"rank {rank}: instrumented {plan} run trained different losses")
                busiest = max(timer.per_thread.values())
                share = (window.in_progress - busiest) / window.in_progress
                stats = torch.tensor(
                    [
                        share,
                        window.in_progress / args.steps,
                        busiest / args.steps,
                        (window.in_progress - busiest) / args.steps,
                    ],
                    dtype=torch.float64,
                )
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the worse rank
                engine[plan] = {
                    "share": float(stats[0]),
                    "step_ms": float(stats[1]) * 1e3,
                    "task_ms": float(stats[2]) * 1e3,
                    "engine_us": float(stats[3]) * 1e6,
                    "threads": {k: round(v / args.steps * 1e3, 3) for k, v in timer.per_thread.items()},
                    "tasks": {k: round(v / args.steps * 1e3, 3) for k, v in timer.per_task.items()},
                }
        finally:
            uninstall()

    # Report.
    samples = args.batch_size * world * args.steps
    sps = {v: statistics.median(samples / s for s in seconds[v]) for v in VARIANTS}
    spread = {v: (min(samples / s for s in seconds[v]), max(samples / s for s in seconds[v])) for v in VARIANTS}
    cpu_ms = {v: statistics.median(cpu[v]) / args.steps * 1e3 for v in VARIANTS}
    vs_torchrec = {p: sps[p] / sps[TORCHREC] for p in ENGINE_PLANS}
    vs_serial = {v: sps[v] / sps["serial"] for v in (*PIPELINED, TORCHREC)}
    if main_rank:
        print()
        print(
            f"{'variant':<17} {'samples/s':>10} {'(min..max)':>16} {'ms/step':>8} {'CPU ms/step':>12} "
            f"{'vs torchrec':>12} {'vs serial':>10} {'engine share':>13} {'engine µs/step':>15}"
        )
        for v in VARIANTS:
            lo, hi = spread[v]
            share = f"{engine[v]['share'] * 100:.1f} %" if v in engine else "-"
            us = f"{engine[v]['engine_us']:.0f}" if v in engine else "-"
            print(
                f"{v:<17} {sps[v]:>10.1f} {f'({lo:.0f}..{hi:.0f})':>16} "
                f"{samples / sps[v] / args.steps * 1e3:>8.2f} {cpu_ms[v]:>12.2f} "
                f"{(f'{vs_torchrec[v]:.3f}x' if v in vs_torchrec else '-'):>12} "
                f"{(f'{vs_serial[v]:.3f}x' if v in vs_serial else '-'):>10} {share:>13} {us:>15}"
            )
        if engine:
            print(
                "\nengine share (instrumented run, worse rank): time in progress() per step, task bodies of the "
                "busiest "
                "thread per step, per-thread task ms/step:"
            )
            for plan, e in engine.items():
                print(
                    f"  {plan:<17} {e['step_ms']:.2f} ms/step in progress(), {e['task_ms']:.2f} ms task bodies "
                    f"-> engine {e['engine_us']:.0f} µs/step ({e['share'] * 100:.1f} %)"
                )
                print(f"    rank 0 task ms/step by thread {e['threads']}")
                print(f"    rank 0 task ms/step by task   {e['tasks']}")
        targets = {p: {"vs_torchrec": vs_torchrec[p] >= 1.0, "vs_serial": vs_serial[p] >= 1.0} for p in PIPELINED}
        print(f"\ntargets (pipelined >= 1.0x torchrec and >= serial): {targets}")
        print("per-step losses bitwise equal across all variants and repetitions: yes", flush=True)
        print(
            json.dumps(
                {
                    "samples_per_s": {v: round(sps[v], 2) for v in VARIANTS},
                    "ratio_vs_torchrec": {p: round(r, 4) for p, r in vs_torchrec.items()},
                    "ratio_vs_serial": {p: round(r, 4) for p, r in vs_serial.items()},
                    "engine_share": {p: round(e["share"], 4) for p, e in engine.items()},
                    "cpu_ms_per_step": {v: round(cpu_ms[v], 3) for v in VARIANTS},
                    "engine_us_per_step": {p: round(e["engine_us"], 1) for p, e in engine.items()},
                    "steps": args.steps,
                    "repeats": args.repeats,
                    "world_size": world,
                    "batch_size": args.batch_size,
                    "warmup": args.warmup,
                    "targets_met": targets,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    code = 0
    try:
        main()
        if dist.is_initialized():
            dist.barrier()
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
