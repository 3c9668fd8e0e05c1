"""A recording stream backend and a happens-before checker, for proving stream ordering on CPU.

CI has no GPU, so stream/event correctness is checked symbolically: recording streams log every
`wait_event`, `wait_stream`, `record_event` and the begin/end of each task's work, in the order
they were submitted (from any thread). `check_happens_before` replays that log under CUDA
semantics (each stream is FIFO; `wait_event` orders after the work recorded before the event;
`wait_stream` orders after everything submitted to the other stream so far) with vector clocks,
and checks every declared dependency of every executed task instance against the producer
instance for the right batch, derived independently from the declarations.

On a GPU, `cuda_spin` enqueues device work of a given length, so that a test can make a producer
slow enough for a missing wait to show up as a wrong value (tests/cuda).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from recsys_pipe.engine.streams import StreamPool
from recsys_pipe.engine.task import BATCH_CPU, Task
from recsys_pipe.engine.task_graph import TaskGraph


@dataclass(frozen=True)
class StreamOp:
    stream: str
    kind: str  # "wait_event" | "wait_stream" | "record" | "begin" | "end"
    arg: Any  # event id, other stream name, or (task, batch) label


class RecordingEvent:
    __slots__ = ("id",)

    def __init__(self, event_id: int):
        self.id = event_id

    def __repr__(self) -> str:
        return f"RecordingEvent({self.id})"


class StreamLog:
    """Thread-safe, submission-ordered list of stream operations."""

    def __init__(self) -> None:
        self.ops: list[StreamOp] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def append(self, op: StreamOp) -> None:
        with self._lock:
            self.ops.append(op)

    def new_event(self, stream: str) -> RecordingEvent:
        with self._lock:
            event = RecordingEvent(next(self._ids))
            self.ops.append(StreamOp(stream, "record", event.id))
        return event

    def record_again(self, stream: str, event: RecordingEvent) -> RecordingEvent:
        """`event` recorded once more, now on `stream`: as a CUDA event recorded again, a later
        wait on it waits for this record (a wait logged before it keeps the earlier one)."""
        self.append(StreamOp(stream, "record", event.id))
        return event


class RecordingStream:
    """Logs what would be submitted to a CUDA stream. `drop_waits` simulates a broken engine
    (used to show the checker is not vacuous)."""

    def __init__(self, name: str, log: StreamLog, drop_waits: bool = False):
        self.name = name
        self.log = log
        self.drop_waits = drop_waits

    def wait_event(self, event: RecordingEvent) -> None:
        if not self.drop_waits:
            self.log.append(StreamOp(self.name, "wait_event", event.id))

    def wait_stream(self, other: RecordingStream) -> None:
        if not self.drop_waits:
            self.log.append(StreamOp(self.name, "wait_stream", other.name))

    def record_event(self, event: Any = None) -> RecordingEvent:
        if isinstance(event, RecordingEvent):
            return self.log.record_again(self.name, event)
        return self.log.new_event(self.name)

    @contextlib.contextmanager
    def scope(self, label: Any) -> Iterator[None]:
        self.log.append(StreamOp(self.name, "begin", label))
        yield
        self.log.append(StreamOp(self.name, "end", label))

    def synchronize(self) -> None:
        pass


def recording_pool(names: Iterable[str], drop_waits: bool = False) -> tuple[StreamPool, StreamLog]:
    log = StreamLog()
    return StreamPool({n: RecordingStream(n, log, drop_waits) for n in names}), log


def required_producers(task_graph: TaskGraph, task: Task, batch: int) -> list[tuple[str, int, str]]:
    """(producer, producer's batch, why) that must finish before `task` processes `batch`."""
    tasks = {t.name: t for t in task_graph.tasks}
    c = task
    out: list[tuple[str, int, str]] = []
    for slot in c.reads:
        if slot.name == BATCH_CPU:
            continue
        writers = sorted(
            (w.batch_offset, t.name)
            for t in task_graph.tasks
            if t is not c
            for w in t.writes
            if w.name == slot.name and w.batch_offset >= slot.batch_offset
        )
        if writers:
            k, name = writers[0]
            # The value in ring.at(j) now was written k - j iterations ago into ring.at(k);
            # its writer then processed batch (i - (k - j)) - L + X.la.
            out.append((name, batch - c.lookahead + slot.batch_offset - k + tasks[name].lookahead, f"reads {slot}"))
    for name in c.depends_on:
        out.append((name, batch, "depends_on"))
    for name, offset in c.cross_iter_depends_on:
        out.append((name, batch + offset, f"cross_iter_depends_on {offset}"))
    for name in c.same_progress_sync:
        out.append((name, batch - c.lookahead + tasks[name].lookahead, "same_progress_sync"))
    return out


def check_happens_before(log: StreamLog, task_graph: TaskGraph) -> list[str]:
    """Violations (empty when every dependency of every executed instance is ordered)."""
    clocks: dict[str, dict[str, int]] = {}
    event_clock: dict[int, dict[str, int]] = {}
    begin_clock: dict[tuple[str, int], dict[str, int]] = {}
    end_position: dict[tuple[str, int], tuple[str, int]] = {}
    violations: list[str] = []

    def tick(stream: str) -> dict[str, int]:
        clock = clocks.setdefault(stream, {})
        clock[stream] = clock.get(stream, 0) + 1
        return clock

    def merge(into: dict[str, int], other: dict[str, int]) -> None:
        for s, n in other.items():
            if n > into.get(s, 0):
                into[s] = n

    for op in log.ops:
        clock = clocks.setdefault(op.stream, {})
        if op.kind == "wait_event":
            merge(clock, event_clock[op.arg])
        elif op.kind == "wait_stream":
            merge(clock, clocks.get(op.arg, {}))
        elif op.kind == "record":
            event_clock[op.arg] = dict(tick(op.stream))
        elif op.kind == "begin":
            label = tuple(op.arg)
            if label in begin_clock:
                violations.append(f"{label[0]} ran twice on batch {label[1]}")
            begin_clock[label] = dict(tick(op.stream))
        elif op.kind == "end":
            end_position[tuple(op.arg)] = (op.stream, tick(op.stream)[op.stream])

    tasks = {t.name: t for t in task_graph.tasks}
    for (name, batch), clock in begin_clock.items():
        for producer, producer_batch, why in required_producers(task_graph, tasks[name], batch):
            position = end_position.get((producer, producer_batch))
            if position is None:
                continue  # that producer instance never ran (prefill / drain / before batch 0)
            stream, n = position
            if clock.get(stream, 0) < n:
                violations.append(
                    f"{name}[batch {batch}] ({why}) is not ordered after "
                    f"{producer}[batch {producer_batch}] on stream '{stream}'"
                )
    return violations


# -- real CUDA streams ----------------------------------------------------------------------------

_SPIN_CYCLES_PER_MS: dict[int, float] = {}


def cuda_spin(ms: float) -> None:
    """Enqueue a kernel that keeps the current CUDA stream busy for about `ms` milliseconds.

    A stand-in for device work of a known length (a long producer in the ordering tests, the
    communication of the GPU benchmark). `torch.cuda._sleep` spins a number of GPU clock cycles;
    the cycles per millisecond are measured once per device with CUDA events, after a warm-up
    spin that lets the clock leave its idle frequency, so lengths are approximate (the clock may
    still change) and callers that need exact figures time the work themselves.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_spin needs a CUDA device (on CPU, sleep on the task's thread instead)")
    if ms <= 0:
        return
    device = torch.cuda.current_device()
    rate = _SPIN_CYCLES_PER_MS.get(device)
    if rate is None:
        rate = _SPIN_CYCLES_PER_MS[device] = _measure_spin_rate()
    torch.cuda._sleep(max(1, int(ms * rate)))


def _measure_spin_rate(cycles: int = 20_000_000) -> float:
    """GPU clock cycles per millisecond of `torch.cuda._sleep` on the current device (median of 3),
    measured on a side stream so no caller's stream is disturbed."""
    stream = torch.cuda.Stream()
    rates = []
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)  # warm-up: the first spin runs while the clock ramps up
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rates.append(cycles / start.elapsed_time(end))
    return sorted(rates)[1]
