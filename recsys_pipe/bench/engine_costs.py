"""What the engine pays per task on a device, split: entering the task's stream, recording its
completion event, waiting on another stream's event (and the prefill fallback, waiting on a
whole stream), and handing work to another thread (the threaded executor's latch, and its
queue hand-over of a worker's chain), each timed on its own in a loop of `--calls`.

    recsys-bench engine_costs            # CUDA streams where there is a GPU, else the no-op ones
    recsys-bench engine_costs --quick    # CI: a few thousand calls

The streams and events are the engine's own (`StreamPool.create`: real CUDA streams and
`torch.cuda.Event`s on a GPU, `NoOpStream`s elsewhere), called as the plan runner calls them
(`StreamPool.use`, `record_event`, `wait_event`, `wait_stream`), so the figures add up to the
per-task cost `recsys-bench gpu` measured in a launch-bound plan (14-27 µs sequential, 49-55
threaded on an H100/H200, against 0.5 and 5 µs without CUDA). Median and min-max over
`--repeats` loops, in µs per call; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from recsys_pipe.bench.common import format_summary, summary
from recsys_pipe.engine import StreamPool
from recsys_pipe.engine.threaded import closed_latch, open_latch

__all__ = ["main", "measure_costs"]


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
        "event_wait": lambda: _per_call_us(wait, calls),
        "stream_wait": lambda: _per_call_us(wait_stream, calls),
        "latch_hand_off": lambda: _ping_pong(_latch_pair, max(calls // 10, 100)),
        "queue_hand_off": lambda: _ping_pong(_queue_pair, max(calls // 10, 100)),
    }
    samples: dict[str, list[float]] = {name: [] for name in loops}
    for rep in range(repeats):
        names = list(loops)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            samples[name].append(loops[name]())
            sync()
    return {name: summary(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="recsys-bench engine_costs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2,000 calls, 3 repetitions")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.repeats = 2000, 3
    device = torch.device(args.device)
    costs = measure_costs(device, args.calls, args.repeats)
    streams = "CUDA streams" if device.type == "cuda" else "no-op streams"
    print(f"engine costs on {device} ({streams}), µs per call, median (min–max) of {args.repeats}:")
    for name, s in costs.items():
        print(f"  {name:<16} {format_summary(s)}")
    print(json.dumps({"device": str(device), "streams": streams, "calls": args.calls, "us_per_call": costs}))


if __name__ == "__main__":
    main()
