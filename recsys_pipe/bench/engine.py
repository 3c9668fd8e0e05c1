"""The engine's own cost and its overlap, measured side by side in one process.

Every repetition runs every configuration once (in a rotated order), so a slow spell of a
shared machine hits all configurations alike; the figures are medians over repetitions, with
min-max. Measures:

1. sequential: no-op tasks (a 10-task chain over 3 lookaheads and 3 streams), engine time
   minus a plain loop calling the same functions, per task. Target: <= 1.5 µs/task.
2. threaded: the same task graph on `ThreadedExecutor("by_stream")` (3 threads). Target:
   <= 5 µs/task.
3. threaded scaling: 1, 2 and 4 threads x 10, 30 and 100 tasks (thread k runs the k-th
   contiguous block of the chain), per task. Shows the fixed cost of waking worker threads
   being spread over more tasks.
4. overlap: GIL-releasing tasks (`time.sleep`) on two thread groups. Iteration time over the
   ideal bound (per iteration, the largest summed task time of one thread, from a
   `SpanRecorder`; target <= 1.05) and over the sequential time of the same task_graph.
5. plans: the shipped plans, composed and compiled as `recsys-train` does (their tasks,
   lookaheads, streams, dependencies and nccl flags) with no-op task functions, per executor and
   thread map: engine µs per training step, and that as a share of a `--step-ms` step (default 15 ms,
   an HSTU step on a 2-core CPU). With no-op tasks every thread hand-off is on the critical
   path, so this is an upper bound of what the engine adds to a real step. Target: <= 0.5 %.
   Each threaded configuration is measured twice, side by side: with the process's threads on
   one core (`one_core`, the placement of a rank in `recsys-bench train`, whose step the share
   is of) and where the operating system puts them (`os`). The target is judged on `one_core`;
   `os` is reported with it. A hand-off between two Python threads on one core is a context
   switch; across cores it also wakes the other, idle core, which costs about three times as
   much on a virtual machine.

The table goes to stdout; the last line is one JSON object with every figure. `--no-plans` leaves
out measure 5, which composes the plans through the launcher's config and training packages
(Hydra, pydantic, torchrec): for machines that have only torch, such as the GPU machine.

    recsys-bench engine [--repeats R] [--iterations N] [--quick] [--no-plans]
    python -m recsys_pipe.bench.engine ...    # the same, without the console script
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

from recsys_pipe.bench.common import format_summary as fmt
from recsys_pipe.bench.common import summary
from recsys_pipe.engine import PlanRunner, SpanRecorder, Task, TaskGraph, ThreadedExecutor

PLANS = ("serial", "sparse_dist", "hstu_sparse_dist", "hstu_prefetch")
THREAD_MAPS = ("hstu_default", "by_stream", "per_task", "single")
SCALING = tuple((threads, tasks) for tasks in (10, 30, 100) for threads in (1, 2, 4))
TARGETS = {
    "sequential_us_per_task": 1.5,
    "threaded_us_per_task": 5.0,
    "overlap_ratio_vs_ideal": 1.05,
    "plan_share_percent": 0.5,
}
#: whether this OS lets a thread choose its cores (Linux); elsewhere only the OS placement is measured
PINNING = hasattr(os, "sched_setaffinity")


def noop(ctx: Any) -> None:
    """A task body that does nothing: what remains of a step is the engine's own cost."""


# -- task graphs ------------------------------------------------------------------------------------


def chain_task_graph(
    num_tasks: int,
    fn: Callable[[Any], None] = noop,
    streams: tuple[str, str, str] = ("memcpy", "data_dist", "default"),
    declared: tuple[str, ...] | None = None,
) -> TaskGraph:
    """`num_tasks` tasks running `fn` in a chain over three lookaheads, on `streams` (one per
    lookahead 2, 1, 0; `declared`: the graph's streams, default those three): the launch-bound
    chain `recsys-bench engine`, `gpu` and `engine_costs` time."""
    tasks: list[Task] = []
    for i in range(num_tasks):
        la = 2 - min(2, i * 3 // num_tasks)
        deps = [f"t{i - 1}"] if i and tasks[-1].lookahead >= la else []
        tasks.append(Task.from_fn(f"t{i}", fn, lookahead=la, stream=streams[2 - la], depends_on=deps))
    return TaskGraph.single_group(tasks, declared or (streams[2], streams[0], streams[1]))


def shipped_plan(name: str, thread_map: str | None = None) -> tuple[TaskGraph, dict[str, str] | None]:
    """A shipped plan exactly as `recsys-train` composes and compiles it (Hydra config, plan
    derivation, thread map), with every task function replaced by a no-op; and its thread of
    each task (None for the sequential executor)."""
    from recsys_pipe.testing import load_run
    from recsys_pipe.train import training_plan

    overrides = [f"pipeline={name}"] + ([f"thread_map={thread_map}"] if thread_map else [])
    plan = training_plan(load_run(*overrides), resolve_fn=lambda path: noop)
    return plan.task_graph, (dict(plan.thread_of) if plan.threaded else None)


# -- measures (one repetition each) ---------------------------------------------------------------


def timed(runner: PlanRunner, batches: int) -> float:
    """Seconds to train `batches` batches (prefill and drain included)."""
    start = time.perf_counter()
    for _ in runner.iterate(range(batches)):
        pass
    return time.perf_counter() - start


def plain_loop(task_graph: TaskGraph, iterations: int) -> float:
    """Seconds a plain loop takes to call the task graph's task functions `iterations` times, in order."""
    tasks = task_graph.tasks
    start = time.perf_counter()
    for _ in range(iterations):
        for task in tasks:
            task.fn(None)
    return time.perf_counter() - start


def overhead_us_per_task(task_graph: TaskGraph, executor: Any, iterations: int) -> float:
    """Engine time minus a plain loop over the same functions, per task invocation."""
    with PlanRunner(task_graph, executor=executor) as runner:
        timed(runner, 20)  # warm: plans cached, workers started
        engine = timed(runner, iterations)
    plain = plain_loop(task_graph, iterations)
    return (engine - plain) / (iterations * len(task_graph.tasks)) * 1e6


def overlap(iterations: int, sleep_ms: float) -> dict[str, float]:
    """io thread: h2d (la 2) + input_dist (la 1); compute thread: forward + backward (la 0)."""

    def sleeper(ctx: Any) -> None:
        time.sleep(sleep_ms / 1e3)

    task_graph = TaskGraph.single_group(
        [
            Task.from_fn("h2d", sleeper, lookahead=2, stream="memcpy"),
            Task.from_fn("input_dist", sleeper, lookahead=1, stream="data_dist", depends_on=["h2d"]),
            Task.from_fn("forward", sleeper, lookahead=0),
            Task.from_fn("backward", sleeper, lookahead=0, depends_on=["forward"]),
        ]
    )
    threads = {"h2d": "io", "input_dist": "io", "forward": "compute", "backward": "compute"}
    recorder = SpanRecorder()
    with PlanRunner(task_graph, executor=ThreadedExecutor(threads), observer=recorder) as runner:
        threaded = timed(runner, iterations)
    per_iteration: dict[int, dict[str, float]] = {}
    for span in recorder.spans():
        per_thread = per_iteration.setdefault(span.iteration, {})
        per_thread[span.thread] = per_thread.get(span.thread, 0.0) + span.duration_s
    ideal = sum(max(per_thread.values()) for per_thread in per_iteration.values())
    with PlanRunner(task_graph, executor="sequential") as runner:
        serial = timed(runner, iterations)
    return {
        "iteration_ms_threaded": threaded / iterations * 1e3,
        "iteration_ms_ideal": ideal / iterations * 1e3,
        "iteration_ms_serial": serial / iterations * 1e3,
        "ratio_vs_ideal": threaded / ideal,
        "ratio_vs_serial": threaded / serial,
    }


def plan_us_per_step(task_graph: TaskGraph, executor: Any, steps: int) -> float:
    """Engine µs per step of `task_graph` with no-op tasks on `executor` (after 20 untimed steps)."""
    with PlanRunner(task_graph, executor=executor) as runner:
        timed(runner, 20)
        return timed(runner, steps) / steps * 1e6


def on_one_core(run: Callable[[], float]) -> Callable[[], float]:
    """`run` with the calling thread on one core, and so every worker thread it starts (a new
    thread inherits its creator's affinity; the executor starts its workers on first use). The
    caller's affinity is restored afterwards."""

    def pinned() -> float:
        allowed = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(allowed)})
        try:
            return run()
        finally:
            os.sched_setaffinity(0, allowed)

    return pinned


# -- driver ---------------------------------------------------------------------------------------


def main() -> None:
    """Measure every configuration in interleaved repetitions; print the table, then the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9, help="interleaved repetitions (median and min-max)")
    parser.add_argument("--iterations", type=int, default=2000, help="batches per no-op overhead run")
    parser.add_argument("--overlap-iterations", type=int, default=100)
    parser.add_argument("--sleep-ms", type=float, default=2.0, help="task duration in the overlap measure")
    parser.add_argument("--step-ms", type=float, default=15.0, help="training step the plan share is relative to")
    parser.add_argument("--quick", action="store_true", help="smoke test: few iterations, 2 repetitions")
    parser.add_argument("--no-plans", action="store_true", help="skip the shipped plans (needs only torch)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.iterations, args.overlap_iterations, args.sleep_ms = 2, 100, 8, 1.0
    runs = measurements(args)
    samples: dict[str, list] = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(runs[name]())
    report = build_report(samples, args)
    report["targets"] = {"limits": TARGETS, "met": targets_met(report)}
    print_table(report)
    print(json.dumps(report))


def measurements(args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    """Every configuration, by name, as a function that measures it once: the overheads of the
    sequential and threaded executors, the overlap, the thread scaling and the shipped plans."""
    chain10 = chain_task_graph(10)
    runs: dict[str, Callable[[], Any]] = {
        "sequential": lambda: overhead_us_per_task(chain10, "sequential", args.iterations),
        "threaded": lambda: overhead_us_per_task(chain10, ThreadedExecutor("by_stream"), args.iterations),
        "overlap": lambda: overlap(args.overlap_iterations, args.sleep_ms),
    }
    for threads, tasks in SCALING:
        task_graph = chain_task_graph(tasks)
        iterations = max(20, args.iterations * 10 // tasks)

        def blocks(task: Task, threads: int = threads, tasks: int = tasks) -> str:
            return f"w{int(task.name[1:]) * threads // tasks}"

        runs[f"scaling/{threads}x{tasks}"] = lambda s=task_graph, b=blocks, n=iterations: overhead_us_per_task(
            s, ThreadedExecutor(b), n
        )
    for plan in () if args.no_plans else PLANS:
        _, threads = shipped_plan(plan)
        for tm in ("sequential",) if threads is None else THREAD_MAPS:
            task_graph, thread_of = shipped_plan(plan, None if tm == "sequential" else tm)

            def make(thread_of: dict[str, str] | None = thread_of) -> Any:
                return "sequential" if thread_of is None else ThreadedExecutor(dict(thread_of))

            def run(s: TaskGraph = task_graph, m: Callable[[], Any] = make) -> float:
                return plan_us_per_step(s, m(), args.iterations)

            runs[f"plan/{plan}/{tm}"] = run
            if thread_of is not None and PINNING:
                runs[f"plan/{plan}/{tm}/one_core"] = on_one_core(run)
    return runs


def build_report(samples: dict[str, list], args: argparse.Namespace) -> dict[str, Any]:
    """Medians (min-max) of every measurement, and each plan's share of a `--step-ms` step."""
    report: dict[str, Any] = {
        "machine": {"repeats": args.repeats, "iterations": args.iterations, "step_ms": args.step_ms},
        "sequential": {"overhead_us_per_task": summary(samples["sequential"])},
        "threaded": {"overhead_us_per_task": summary(samples["threaded"])},
        "scaling": {
            f"{threads}x{tasks}": {"threads": threads, "tasks": tasks, **summary(samples[f"scaling/{threads}x{tasks}"])}
            for threads, tasks in SCALING
        },
        "overlap": {key: summary([s[key] for s in samples["overlap"]], 4) for key in samples["overlap"][0]},
        "plans": {},
    }
    for name in samples:
        if name.startswith("plan/"):
            _, plan, tm, *placement = name.split("/")
            figures = {
                "us_per_step": summary(samples[name], 1),
                "share_percent": summary((v / (args.step_ms * 1e3) * 100 for v in samples[name]), 3),
            }
            entry = report["plans"].setdefault(f"{plan}/{tm}", {})
            entry.update({"one_core": figures} if placement else figures)
    return report


def targets_met(report: dict[str, Any]) -> dict[str, bool]:
    """Which of `TARGETS` the report meets (the plans' shares with the default thread maps and
    all of them, on one core and placed by the OS)."""
    met = {
        "sequential_us_per_task": report["sequential"]["overhead_us_per_task"]["median"]
        <= TARGETS["sequential_us_per_task"],
        "threaded_us_per_task": report["threaded"]["overhead_us_per_task"]["median"] <= TARGETS["threaded_us_per_task"],
        "overlap_ratio_vs_ideal": report["overlap"]["ratio_vs_ideal"]["median"] <= TARGETS["overlap_ratio_vs_ideal"],
    }
    if report["plans"]:
        limit = TARGETS["plan_share_percent"]

        def within(entries: list[dict[str, Any]], one_core: bool) -> bool:
            """Every entry's median share at most the limit: its one-core figure where it has
            one (threaded executors) with `one_core`, else the OS placement's."""
            return all((e.get("one_core", e) if one_core else e)["share_percent"]["median"] <= limit for e in entries)

        shipped = [p for key, p in report["plans"].items() if key.split("/")[1] in ("sequential", "hstu_default")]
        every = list(report["plans"].values())
        met["plan_share_percent_default_maps"] = within(shipped, one_core=True)
        met["plan_share_percent_all_maps"] = within(every, one_core=True)
        met["plan_share_percent_default_maps_os_placement"] = within(shipped, one_core=False)
        met["plan_share_percent_all_maps_os_placement"] = within(every, one_core=False)
    return met


def print_table(report: dict[str, Any]) -> None:
    """Print the report as a table with each measure's target."""
    m = report["machine"]
    print(f"engine benchmark: medians (min–max) over {m['repeats']} interleaved repetitions")
    print(f"{'measure':<56} {'result':<32} target")
    rows = [
        ("sequential overhead, µs/task", fmt(report["sequential"]["overhead_us_per_task"]), "<= 1.5"),
        ("threaded overhead (3 threads), µs/task", fmt(report["threaded"]["overhead_us_per_task"]), "<= 5"),
    ]
    for s in report["scaling"].values():
        rows.append((f"  threaded {s['threads']} thread(s) x {s['tasks']} tasks, µs/task", fmt(s), ""))
    o = report["overlap"]
    rows += [
        ("overlap: iteration / ideal bound", fmt(o["ratio_vs_ideal"]), "<= 1.05"),
        ("overlap: iteration / sequential", fmt(o["ratio_vs_serial"]), ""),
        ("overlap: iteration ms (threaded)", fmt(o["iteration_ms_threaded"]), ""),
    ]
    for key, p in report["plans"].items():
        for label, figures in (("", p), (", one core", p.get("one_core"))):
            if figures:
                share = f"{fmt(figures['share_percent'], ' %')} of {m['step_ms']} ms"
                rows.append((f"plan {key}{label}, µs/step", fmt(figures["us_per_step"]), share))
    for name, result, target in rows:
        print(f"{name:<56} {result:<32} {target}")
    met = report["targets"]["met"]
    print("targets met: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in met.items()))


if __name__ == "__main__":
    main()
