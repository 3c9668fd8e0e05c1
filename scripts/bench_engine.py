#!/usr/bin/env python
"""Engine cost and overlap, measured side by side in one process.

1. Sequential executor overhead on no-op tasks against a plain Python loop calling the same
   functions (µs/task and ratio). Target: <= 20 µs/task.
2. Threaded executor overhead on the same no-op tasks. Target: <= 60 µs/task.
3. Overlap: GIL-releasing tasks (time.sleep) on two thread groups. Reports measured iteration
   time / ideal bound (max over threads of the summed measured task time per iteration; target
   <= 1.05) and / the sequential time of the same schedule.

The last line printed is one JSON object with all figures.

    .venv/bin/python scripts/bench_engine.py [--iterations N] [--repeats R] [--sleep-ms MS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from recsys_pipe.engine import SchedulablePipeline, Schedule, Task, ThreadedExecutor


def noop(ctx) -> None:
    pass


def noop_schedule(num_tasks: int) -> Schedule:
    """A realistic shape: a chain of tasks over three lookaheads and three streams."""
    streams = ("memcpy", "data_dist", "default")
    tasks = []
    for i in range(num_tasks):
        la = 2 - min(2, i * 3 // num_tasks)
        deps = [f"t{i - 1}"] if i and tasks[-1].lookahead >= la else []
        tasks.append(Task.from_fn(f"t{i}", noop, lookahead=la, stream=streams[2 - la], depends_on=deps))
    return Schedule.single_stage(tasks, ("default", "memcpy", "data_dist"))


def drive(pipe: SchedulablePipeline, iterations: int) -> float:
    it = iter(range(iterations))
    start = time.perf_counter()
    while True:
        try:
            pipe.progress(it)
        except StopIteration:
            return time.perf_counter() - start


def plain_loop(schedule: Schedule, iterations: int) -> float:
    tasks = schedule.tasks
    start = time.perf_counter()
    for _ in range(iterations):
        for task in tasks:
            task.fn(None)
    return time.perf_counter() - start


def overhead(executor_factory, iterations: int, repeats: int, num_tasks: int) -> dict:
    schedule = noop_schedule(num_tasks)
    engine, plain = [], []
    for _ in range(repeats):
        with SchedulablePipeline(schedule, executor=executor_factory()) as pipe:
            drive(pipe, 20)  # warm: plans cached, workers started
            engine.append(drive(pipe, iterations))
        plain.append(plain_loop(schedule, iterations))
    calls = iterations * num_tasks
    e, p = statistics.median(engine) / calls * 1e6, statistics.median(plain) / calls * 1e6
    return {
        "engine_us_per_task": round(e, 3),
        "plain_us_per_task": round(p, 3),
        "overhead_us_per_task": round(e - p, 3),
        "ratio_vs_plain": round(e / p, 1),
    }


def overlap(iterations: int, sleep_ms: float, repeats: int) -> dict:
    """io thread: h2d (la 2) + input_dist (la 1); compute thread: forward + backward (la 0)."""
    durations: dict[int, dict[str, float]] = {}
    lock = threading.Lock()

    def sleeper(ctx) -> None:
        start = time.perf_counter()
        time.sleep(sleep_ms / 1e3)
        spent = time.perf_counter() - start
        with lock:
            durations.setdefault(ctx.iter_count, {}).setdefault(THREAD_OF[ctx.task.name], 0.0)
            durations[ctx.iter_count][THREAD_OF[ctx.task.name]] += spent

    THREAD_OF = {"h2d": "io", "input_dist": "io", "forward": "compute", "backward": "compute"}
    schedule = Schedule.single_stage(
        [
            Task.from_fn("h2d", sleeper, lookahead=2, stream="memcpy"),
            Task.from_fn("input_dist", sleeper, lookahead=1, stream="data_dist", depends_on=["h2d"]),
            Task.from_fn("forward", sleeper, lookahead=0),
            Task.from_fn("backward", sleeper, lookahead=0, depends_on=["forward"]),
        ]
    )
    threaded_times, ideal_times, serial_times = [], [], []
    for _ in range(repeats):
        durations.clear()
        with SchedulablePipeline(schedule, executor=ThreadedExecutor(THREAD_OF)) as pipe:
            elapsed = drive(pipe, iterations)
        threaded_times.append(elapsed)
        ideal_times.append(sum(max(per_thread.values()) for per_thread in durations.values()))
        with SchedulablePipeline(schedule, executor="sequential") as pipe:
            serial_times.append(drive(pipe, iterations))
    t, ideal, s = (statistics.median(x) for x in (threaded_times, ideal_times, serial_times))
    return {
        "iteration_ms_threaded": round(t / iterations * 1e3, 3),
        "iteration_ms_ideal": round(ideal / iterations * 1e3, 3),
        "iteration_ms_serial": round(s / iterations * 1e3, 3),
        "ratio_vs_ideal": round(t / ideal, 4),
        "ratio_vs_serial": round(t / s, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=10)
    parser.add_argument("--overlap-iterations", type=int, default=200)
    parser.add_argument("--sleep-ms", type=float, default=2.0)
    args = parser.parse_args()

    seq = overhead(lambda: "sequential", args.iterations, args.repeats, args.tasks)
    thr = overhead(lambda: ThreadedExecutor("by_stream"), args.iterations, args.repeats, args.tasks)
    ovl = overlap(args.overlap_iterations, args.sleep_ms, max(1, args.repeats // 2))
    print(
        f"sequential: {seq['engine_us_per_task']:.2f} µs/task vs plain loop {seq['plain_us_per_task']:.3f} µs/task "
        f"-> overhead {seq['overhead_us_per_task']:.2f} µs/task (target <= 20), {seq['ratio_vs_plain']}x"
    )
    print(
        f"threaded:   {thr['engine_us_per_task']:.2f} µs/task -> overhead {thr['overhead_us_per_task']:.2f} µs/task "
        f"(target <= 60)"
    )
    print(
        f"overlap:    {ovl['iteration_ms_threaded']} ms/iter threaded, ideal {ovl['iteration_ms_ideal']} ms, "
        f"serial {ovl['iteration_ms_serial']} ms -> {ovl['ratio_vs_ideal']}x ideal (target <= 1.05), "
        f"{ovl['ratio_vs_serial']}x serial"
    )
    print(json.dumps({"sequential": seq, "threaded": thr, "overlap": ovl}))


if __name__ == "__main__":
    main()
