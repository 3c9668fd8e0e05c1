"""What the engine pays per task on a device, split: entering the task's stream, recording its
completion event, waiting on another stream's event (and the prefill fallback, waiting on a
whole stream), and handing work to another thread (the threaded executor's latch, and its
queue hand-over of a worker's chain), each timed on its own in a loop of `--calls`; then the
plan runner's whole per-task path on two plans, with the stream operations it makes per task.

    recsys-bench engine_costs            # CUDA streams where there is a GPU, else the no-op ones
    recsys-bench engine_costs --quick    # CI: a few thousand calls
    recsys-bench compare --baseline main engine_costs    # before / after, side by side

The streams and events are the engine's own (`StreamPool.create`: real CUDA streams and
`torch.cuda.Event`s on a GPU, `NoOpStream`s elsewhere), called as the plan runner calls them
(`StreamPool.use`, `record_event`, `wait_event`, `wait_stream`), so the figures add up to the
per-task cost `recsys-bench gpu` measured in a launch-bound plan (14-27 µs sequential, 49-55
threaded on an H100/H200, against 0.5 and 5 µs without CUDA). Two more primitives: recording an
event object again (`event_record_again`, what the engine now does instead of making one per
task) and switching the current stream without a context (`stream_switch`, `StreamPool.enter`,
where this tree has it).

The per-task path (`plan`): no-op tasks of two plans run by `PlanRunner` on the sequential
executor and the threaded one (a thread per stream), µs per task of engine time minus a plain
loop calling the same functions: `chain`, ten tasks over three lookaheads and streams (as
`recsys-bench gpu` times its launch-bound chain), and `prefetch`, the layout of
conf/pipeline/prefetch.yaml (`prefetch_layout`). On a GPU the pool holds CUDA streams; without
one, counting streams (which do nothing, so the engine's own Python on that path is what is
timed: no-op pools skip it). Per steady-state task of each plan, from a counting run: the
waits issued (`waits`), events recorded (`records`) and made (`new_events`), and stream scopes
or switches (`stream_entries`). Median and min-max over `--repeats` loops, in µs per call; the
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from recsys_pipe.bench.common import format_summary, summary
from recsys_pipe.bench.engine import chain_task_graph, noop
from recsys_pipe.engine import PlanRunner, StreamPool, Task, TaskGraph, ThreadedExecutor
from recsys_pipe.engine.threaded import closed_latch, open_latch

__all__ = ["main", "measure_costs", "measure_plans", "prefetch_layout"]

#: the streams of the per-task plans
PLAN_STREAMS = ("default", "memcpy", "data_dist", "prefetch")


def _per_call_us(body: Callable[[int], None], calls: int) -> float:
    start = time.perf_counter()
    body(calls)
    return (time.perf_counter() - start) * 1e6 / calls


def _ping_pong(make: Callable[[], tuple[Callable[[], None], Callable[[], None]]], calls: int) -> float:
    """µs per one-way hand-off between two threads: a round trip is two hand-offs."""
    to_worker, to_caller = make(), make()

    def worker() -> None:
        for _ in range(calls):
            to_worker[1]()  # wait
            to_caller[0]()  # signal back

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    start = time.perf_counter()
    for _ in range(calls):
        to_worker[0]()
        to_caller[1]()
    elapsed = time.perf_counter() - start
    thread.join(timeout=10)
    return elapsed * 1e6 / (2 * calls)


def _latch_pair() -> tuple[Callable[[], None], Callable[[], None]]:
    """The executor's cross-thread edge: a fresh closed latch per hand-off (as per iteration)."""
    box = [closed_latch()]

    def signal() -> None:
        open_latch(box[0])

    def wait() -> None:
        box[0].acquire()
        box[0] = closed_latch()

    return signal, wait


def _queue_pair() -> tuple[Callable[[], None], Callable[[], None]]:
    """The executor's hand-over of a chain to a worker: a put on the worker's queue."""
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    return (lambda: jobs.put(None)), jobs.get


def measure_costs(device: torch.device, calls: int, repeats: int) -> dict[str, Any]:
    pool = StreamPool.create(["default", "side"], device)
    event = pool.record_event("side")
    sync = pool.synchronize

    def enter(n: int) -> None:
        for _ in range(n):
            with pool.use("side", None):
                pass

    def record(n: int) -> None:
        for _ in range(n):
            pool.record_event("side")

    side = pool.get("side")

    def record_again(n: int) -> None:
        again = side.record_event()
        for _ in range(n):
            side.record_event(again)

    def switch(n: int) -> None:
        enter = pool.enter
        for _ in range(n // 2):
            enter("side")
            enter("default")

    def wait(n: int) -> None:
        for _ in range(n):
            pool.wait_event("default", event)

    def wait_stream(n: int) -> None:
        for _ in range(n):
            pool.wait_stream("default", "side")

    def nothing(n: int) -> None:
        for _ in range(n):
            pass

    loops: dict[str, Callable[[], float]] = {
        "loop": lambda: _per_call_us(nothing, calls),
        "stream_entry": lambda: _per_call_us(enter, calls),
        "event_record": lambda: _per_call_us(record, calls),
        "event_record_again": lambda: _per_call_us(record_again, calls),
        "event_wait": lambda: _per_call_us(wait, calls),
        "stream_wait": lambda: _per_call_us(wait_stream, calls),
        "latch_hand_off": lambda: _ping_pong(_latch_pair, max(calls // 10, 100)),
        "queue_hand_off": lambda: _ping_pong(_queue_pair, max(calls // 10, 100)),
    }
    if hasattr(pool, "enter"):  # this tree's StreamPool (a baseline's may not have it)
        loops["stream_switch"] = lambda: _per_call_us(switch, calls)
        sync = _restoring(pool, sync)
    samples: dict[str, list[float]] = {name: [] for name in loops}
    for rep in range(repeats):
        names = list(loops)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            samples[name].append(loops[name]())
            sync()
    return {name: summary(values) for name, values in samples.items()}


def _restoring(pool: StreamPool, sync: Callable[[], None]) -> Callable[[], None]:
    """`sync`, then the default stream current again (after the `stream_switch` loop)."""

    def run() -> None:
        sync()
        pool.enter("default")

    return run


# -- the plan runner's per-task path ------------------------------------------------------------


def chain_layout(fn: Callable[[Any], None] = noop, num_tasks: int = 10) -> TaskGraph:
    """`recsys-bench gpu`'s launch-bound chain of `num_tasks` tasks over three lookaheads and
    streams, declared with the per-task plans' streams."""
    return chain_task_graph(num_tasks, fn, ("memcpy", "data_dist", "default"), PLAN_STREAMS)


def prefetch_layout(fn: Callable[[Any], None] = noop) -> TaskGraph:
    """The tasks, lookaheads, streams and dependencies of conf/pipeline/prefetch.yaml (torchrec's
    PrefetchTrainPipelineSparseDist layout) with `fn` as every task's body; a unit test keeps it
    equal to the composed plan."""

    def task(name: str, **fields: Any) -> Task:
        return Task.from_fn(name, fn, **fields)

    return TaskGraph.single_group(
        [
            task("h2d", lookahead=2, stream="memcpy", reads=["batch_cpu"], writes=["batch_gpu", "torchrec_ctx"]),
            task(
                "start_input_dist",
                lookahead=1,
                stream="data_dist",
                reads=["batch_gpu", "torchrec_ctx"],
                writes=["input_dist_splits"],
                nccl=True,
            ),
            task(
                "wait_input_dist",
                lookahead=1,
                stream="data_dist",
                reads=["input_dist_splits"],
                writes=["input_dist_tensors"],
                nccl=True,
            ),
            task("zero_grad"),
            task(
                "forward",
                reads=["batch_gpu", "torchrec_ctx", "prefetched_input"],
                writes=["loss", "model_out"],
                nccl=True,
                depends_on=["zero_grad"],
            ),
            task(
                "prefetch_embeddings",
                lookahead=1,
                stream="prefetch",
                reads=["input_dist_tensors"],
                writes=["prefetched_input"],
                same_progress_sync=["forward"],
            ),
            task("backward", reads=["loss"], nccl=True, same_progress_sync=["prefetch_embeddings"]),
            task("finalize_model_grads", depends_on=["backward"], nccl=True),
            task(
                "optimizer_step",
                depends_on=["finalize_model_grads"],
                reads=["loss", "model_out", "batch_gpu"],
                writes=["step_result"],
            ),
        ],
        PLAN_STREAMS,
    )


class CountingEvent:
    """An event of a `CountingStream`."""

    __slots__ = ()


class CountingStream:
    """A stream that does nothing but count what the engine asks of it (single-threaded use)."""

    def __init__(self, counts: dict[str, int]):
        self.counts = counts

    def wait_event(self, event: Any) -> None:
        self.counts["waits"] += 1

    def wait_stream(self, other: Any) -> None:
        self.counts["waits"] += 1

    def record_event(self, event: Any = None) -> Any:
        self.counts["records"] += 1
        if event is None:
            self.counts["new_events"] += 1
            event = CountingEvent()
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CountingPool(StreamPool):
    """Counting streams; counts the engine's stream scopes and switches too (`use`, `enter`)."""

    def __init__(self, names: tuple[str, ...]):
        self.counts = dict.fromkeys(("waits", "records", "new_events", "stream_entries"), 0)
        super().__init__({n: CountingStream(self.counts) for n in names})

    def use(self, name: str, label: Any = None) -> Any:
        self.counts["stream_entries"] += 1
        return super().use(name, label)

    def enter(self, name: str) -> None:
        self.counts["stream_entries"] += 1
        super().enter(name)


def _plan_us_per_task(layout: TaskGraph, pool: StreamPool, executor: Any, iterations: int) -> float:
    """Engine time minus a plain loop over the same functions, per task, on `pool`."""
    with PlanRunner(layout, pool, executor) as runner:
        it = itertools.repeat(None)
        for _ in range(20):  # warm: the steady state, plans cached, workers started
            runner.progress(it)
        pool.synchronize()
        start = time.perf_counter()
        for _ in range(iterations):
            runner.progress(it)
        pool.synchronize()
        engine = time.perf_counter() - start
    functions = [t.fn for t in layout.tasks]
    start = time.perf_counter()
    for _ in range(iterations):
        for fn in functions:
            fn(None)
    plain = time.perf_counter() - start
    return (engine - plain) / (iterations * len(functions)) * 1e6


def plan_counts(layout: TaskGraph, iterations: int = 50) -> dict[str, float]:
    """Stream operations per task in the steady state (sequential executor, counting streams)."""
    pool = CountingPool(PLAN_STREAMS)
    with PlanRunner(layout, pool) as runner:
        it = itertools.repeat(None)
        for _ in range(20):
            runner.progress(it)
        before = dict(pool.counts)
        for _ in range(iterations):
            runner.progress(it)
    tasks = iterations * len(layout.tasks)
    return {k: round((pool.counts[k] - before[k]) / tasks, 3) for k in pool.counts}


def measure_plans(device: torch.device, iterations: int, repeats: int) -> dict[str, Any]:
    """The per-task path of each plan, sequential and threaded: µs per task and stream operations."""
    layouts = {"chain": chain_layout(), "prefetch": prefetch_layout()}

    def pool() -> StreamPool:
        return StreamPool.create(PLAN_STREAMS, device) if device.type == "cuda" else CountingPool(PLAN_STREAMS)

    executors = {"sequential": lambda: "sequential", "threaded": lambda: ThreadedExecutor("by_stream")}
    samples: dict[str, list[float]] = {f"{p}_{e}": [] for p in layouts for e in executors}
    for rep in range(repeats):
        keys = list(samples)
        for key in keys[rep % len(keys) :] + keys[: rep % len(keys)]:
            layout, executor = key.split("_")
            samples[key].append(_plan_us_per_task(layouts[layout], pool(), executors[executor](), iterations))
    return {
        "us_per_task": {key: summary(values, 2) for key, values in samples.items()},
        "per_task": {name: plan_counts(layout) for name, layout in layouts.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="recsys-bench engine_costs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=2000, help="iterations of each plan (default 2000)")
    parser.add_argument("--quick", action="store_true", help="2,000 calls, 200 iterations, 3 repetitions")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.iterations, args.repeats = 2000, 200, 3
    device = torch.device(args.device)
    costs = measure_costs(device, args.calls, args.repeats)
    plans = measure_plans(device, args.iterations, args.repeats)
    streams = "CUDA streams" if device.type == "cuda" else "no-op streams"
    print(f"engine costs on {device} ({streams}), µs per call, median (min–max) of {args.repeats}:")
    for name, s in costs.items():
        print(f"  {name:<20} {format_summary(s)}")
    pools = "CUDA streams" if device.type == "cuda" else "counting streams"
    print(f"the plan runner's per-task path ({pools}), µs per task beyond a plain loop:")
    for name, s in plans["us_per_task"].items():
        print(f"  {name:<20} {format_summary(s)}")
    print("stream operations per task, steady state:")
    for name, counts in plans["per_task"].items():
        print(f"  {name:<20} " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    report = {"device": str(device), "streams": streams, "calls": args.calls, "us_per_call": costs, "plan": plans}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
