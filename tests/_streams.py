"""Which event each task instance waited on, and what it read: a stream pool that logs (and can
drop) the engine's waits per task instance, the check of those waits against the ring layout,
a task body whose dependencies are device reads of slow producers, and one small plan per
dependency kind. Shared by the CPU tests (over recording streams) and tests/cuda (over real
CUDA streams).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from typing import Any

import torch

from recsys_pipe.engine import DataSlot, PlanRunner, StreamPool, Task, TaskGraph, TaskGroup
from recsys_pipe.engine.testing import RecordingStream, StreamLog, cuda_spin, required_producers

_SALT = itertools.count(1)


class EventLogPool(StreamPool):
    """A pool that logs, per task instance, the waits its stream was given and the event recorded
    after it; with `drop_waits_of=<stream>` that stream's waits (of the kinds in `drop_kinds`:
    "event", "stream") are logged but not emitted, standing for a broken engine.

    The plan runner calls `wait_event` / `wait_stream` just before `scope(stream, (task, batch))`
    and `record_event` just after it, all on the task's thread; a thread-local links them to the
    label. The engine records an event object again for a later batch (one per producer and ring
    position), so an event is logged as `(event, how many times it was recorded)`: a wait is on
    the record that was the latest when it was issued.
    """

    def __init__(self, streams: Any):
        super().__init__(streams)
        self.drop_waits_of: str | None = None
        self.drop_kinds: frozenset[str] = frozenset()
        self.dropped = 0
        self.waits: dict[tuple[str, int], list[tuple[str, Any]]] = {}
        self.recorded: dict[tuple[str, int], Any] = {}
        self._records: dict[int, int] = {}  # id(event) -> times recorded
        self._lock = threading.Lock()
        self._local = threading.local()

    @classmethod
    def cuda(
        cls, names: Iterable[str], drop_waits_of: str | None = None, drop_kinds: Iterable[str] = ("event", "stream")
    ) -> EventLogPool:
        """Real CUDA streams, as `StreamPool.create(names, "cuda")` makes them."""
        pool = cls.create(names, "cuda")
        pool.drop_waits_of, pool.drop_kinds = drop_waits_of, frozenset(drop_kinds)
        return pool

    @classmethod
    def recording(cls, names: Iterable[str]) -> tuple[EventLogPool, StreamLog]:
        """Recording streams (CPU), whose log `check_happens_before` replays."""
        log = StreamLog()
        return cls({n: RecordingStream(n, log) for n in names}), log

    @property
    def has_scopes(self) -> bool:
        return True  # the plan runner then opens `scope` per task, which links the waits to it

    def _pending(self) -> list:
        pending = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = []
        return pending

    def _dropped(self, name: str, kind: str) -> bool:
        if name == self.drop_waits_of and kind in self.drop_kinds:
            with self._lock:
                self.dropped += 1
            return True
        return False

    def wait_event(self, name: str, event: Any) -> None:
        with self._lock:
            record = (event, self._records.get(id(event), 0))
        self._pending().append(("event", record))
        if not self._dropped(name, "event"):
            super().wait_event(name, event)

    def wait_stream(self, name: str, other: str) -> None:
        self._pending().append(("stream", other))
        if not self._dropped(name, "stream"):
            super().wait_stream(name, other)

    def scope(self, name: str, label: Any):
        waits, self._local.pending = self._pending(), []
        with self._lock:
            self.waits[label] = waits
        self._local.label = label
        return super().scope(name, label)

    def record_event(self, name: str, event: Any = None) -> Any:
        event = super().record_event(name, event)
        with self._lock:
            count = self._records[id(event)] = self._records.get(id(event), 0) + 1
            self.recorded[self._local.label] = (event, count)
        return event


def wait_violations(runner: PlanRunner, pool: EventLogPool, ran: Iterable[tuple[str, int]], batches: int) -> list[str]:
    """Each (task, batch) that ran must have waited, for each cross-stream producer, on exactly the
    record of the event that producer made for the batch whose store sits at the wait's ring offset
    (events move down the ring as it rotates), or, if that producer instance never ran (prefill,
    drain), on the producer's whole stream; in the steady state, after `runner.implied.
    from_iteration`, without the waits stream order implies (`runner.implied`).

    Derived from the ring layout, not from the engine's lookup: at internal iteration i,
    `ring.at(k)` holds batch i - L + k, so a task of lookahead c on batch b finds at offset k the
    store of batch b - c + k, where a producer records its event when it processes that batch.
    """
    graph, implied = runner.graph, runner.implied
    tasks = {t.name: t for t in graph.order}
    L = graph.max_lookahead
    problems = []
    for name, batch in ran:
        i = batch + L - tasks[name].lookahead
        steady = implied.from_iteration is not None and max(L, implied.from_iteration) <= i < batches
        expected = []
        for w, wait in enumerate(graph.event_waits[name]):
            if steady and (name, w) in implied.implied:
                continue
            record = pool.recorded.get((wait.producer, batch - tasks[name].lookahead + wait.slot_offset))
            expected.append(("event", record) if record is not None else ("stream", wait.producer_stream))
        got = pool.waits.get((name, batch), [])
        if len(got) != len(expected) or any(not _same(g, e) for g, e in zip(got, expected)):
            problems.append(
                f"{name}[batch {batch}] waited on {_describe(got, pool)}, expected {_describe(expected, pool)}"
            )
    return problems


def _same(got: tuple[str, Any], expected: tuple[str, Any]) -> bool:
    if got[0] != expected[0]:
        return False
    if got[0] == "stream":
        return got[1] == expected[1]
    return got[1][0] is expected[1][0] and got[1][1] == expected[1][1]


def _describe(waits: list[tuple[str, Any]], pool: EventLogPool) -> str:
    owner = {(id(event), count): label for label, (event, count) in pool.recorded.items()}
    return (
        "["
        + ", ".join(f"event of {owner.get((id(a[0]), a[1]), '?')}" if k == "event" else f"stream {a}" for k, a in waits)
        + "]"
    )


class DeviceTrace:
    """A task body whose every dependency is a device read of a slow producer's output.

    Each task instance runs two steps on its stream:

    1. read: copy the output of every producer instance it must follow (`required_producers`,
       derived from the declarations, not from the engine) before anything else it does;
    2. write: a fresh tensor set to -1, a spin of `delay_ms[task]` (CUDA only), then a fill with
       a value unique to (task, batch, trace).

    Were the engine's wait for a dependency missing, the copy would run while the producer still
    spins and see -1 (or another batch's value): `violations()` reports it. Every output stays
    referenced until the end, so the caching allocator cannot recycle memory under a reader here
    (that hazard has its own test). On CPU everything runs in order, which checks the bookkeeping.
    """

    def __init__(self, delay_ms: dict[str, float] | None = None, size: int = 1 << 14, device: str = "cuda"):
        self.device = device
        self.delay_ms = dict(delay_ms or {})
        self.size = size
        self.salt = next(_SALT) * 1_000_000_000  # no stale value of an earlier trace can match
        self.task_graph: TaskGraph | None = None
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.reads: list[tuple[str, int, str, int, str, torch.Tensor]] = []
        self.absent: list[tuple[str, int, str, int, str]] = []
        self.slot_mismatches: list[str] = []
        self._index: dict[str, int] = {}
        self._lock = threading.Lock()

    def tasks(self, specs: list[dict]) -> list[Task]:
        """Tasks running `body`, one per spec (`Task` fields plus `name`)."""
        tasks = [Task.from_fn(s["name"], self.body, **{k: v for k, v in s.items() if k != "name"}) for s in specs]
        self._index = {t.name: i for i, t in enumerate(tasks)}
        return tasks

    def build(self, specs: list[dict], streams: tuple[str, ...]) -> TaskGraph:
        self.task_graph = TaskGraph(groups=(TaskGroup(tuple(self.tasks(specs))),), stream_slots=streams)
        return self.task_graph

    def value(self, task: str, batch: int) -> int:
        return self.salt + self._index[task] * 100_000 + batch

    def preset(self, task: str, batch: int, delay_ms: float) -> None:
        """Produce `task`'s output for `batch` outside the plan runner, on the current stream: work the
        caller did before the first iteration (e.g. for the batch before the first one)."""
        out = torch.full((self.size,), -1, dtype=torch.int64, device=self.device)
        self._spin(delay_ms)
        out.fill_(self.value(task, batch))
        self.outputs[(task, batch)] = out

    def body(self, ctx: Any) -> None:
        task, batch = ctx.task, ctx.batch_index
        for producer, producer_batch, why in required_producers(self.task_graph, task, batch):
            with self._lock:
                source = self.outputs.get((producer, producer_batch))
            if source is None:
                with self._lock:
                    self.absent.append((task.name, batch, producer, producer_batch, why))
                continue
            copy = source.clone()  # on this task's stream, before anything else it does
            with self._lock:
                self.reads.append((task.name, batch, producer, producer_batch, why, copy))
            if why.startswith("reads "):
                slot = next(s for s in task.reads if why == f"reads {s}")
                if ctx.ring.at(slot.batch_offset).get(slot.name) is not source:
                    with self._lock:
                        self.slot_mismatches.append(
                            f"{task.name}[batch {batch}] found in slot {slot} something other than "
                            f"{producer}[batch {producer_batch}]'s output"
                        )
        out = torch.full((self.size,), -1, dtype=torch.int64, device=self.device)
        self._spin(self.delay_ms.get(task.name, 0.0))
        out.fill_(self.value(task.name, batch))
        with self._lock:
            self.outputs[(task.name, batch)] = out
        for slot in task.writes:
            ctx.ring.at(slot.batch_offset).set(slot.name, out)

    def _spin(self, ms: float) -> None:
        if self.device == "cuda":
            cuda_spin(ms)

    @property
    def ran(self) -> list[tuple[str, int]]:
        """(task, batch) of every instance that ran in the plan runner, presets excluded."""
        return [key for key in self.outputs if key[1] >= 0 and key[0] in self._index]

    def violations(self) -> list[str]:
        """Every read that saw anything but its producer's final value, every producer instance
        that ran after a consumer found it missing, every slot holding the wrong tensor."""
        if self.device == "cuda":
            torch.cuda.synchronize()
        problems = list(self.slot_mismatches)
        for name, batch, producer, producer_batch, why, copy in self.reads:
            expected = self.value(producer, producer_batch)
            if not bool((copy == expected).all()):
                seen = sorted({int(v) for v in copy.unique().tolist()})
                shown = ["unwritten (-1)" if v == -1 else str(v - self.salt) for v in seen[:3]]
                problems.append(
                    f"{name}[batch {batch}] ({why}) read {producer}[batch {producer_batch}] before it was "
                    f"written: saw {', '.join(shown)} instead of {expected - self.salt}"
                )
        for name, batch, producer, producer_batch, why in self.absent:
            if (producer, producer_batch) in self.outputs:
                problems.append(
                    f"{name}[batch {batch}] ({why}) ran on the CPU before {producer}[batch {producer_batch}]"
                )
        return problems


def _producer(la: int, **fields: Any) -> dict:
    return {"name": "X", "lookahead": la, "stream": "s1", "writes": ["x"], **fields}


def _consumer(la: int, stream: str, **fields: Any) -> dict:
    return {"name": "C", "lookahead": la, "stream": stream, **fields}


#: One producer X (stream s1) and one consumer C on another stream, per dependency kind:
#: kind -> (specs, the consumer's edge kind as compiled, Δ = ring advances between them).
DEPENDENCY_KINDS = {
    "slot_read_next_batch": ([_producer(1), _consumer(0, "default", reads=["x"])], "slot", 1),
    "slot_read_same_iteration": ([_producer(0), _consumer(0, "s2", reads=[DataSlot("x", 0)])], "slot", 0),
    "depends_on_across_lookaheads": ([_producer(2), _consumer(0, "default", depends_on=["X"])], "depends_on", 2),
    "depends_on_same_lookahead": ([_producer(1), _consumer(1, "s2", depends_on=["X"])], "depends_on", 0),
    "cross_iter_delta_1": (
        [_producer(1), _consumer(1, "s2", cross_iter_depends_on=[("X", -1)])],
        "cross_iter_depends_on",
        1,
    ),
    "cross_iter_delta_2": (
        [_producer(2), _consumer(1, "s2", cross_iter_depends_on=[("X", -1)])],
        "cross_iter_depends_on",
        2,
    ),
    "same_progress_sync": (
        [_producer(1), _consumer(0, "default", same_progress_sync=["X"])],
        "same_progress_sync",
        0,
    ),
    "cross_iter_promoted": (
        [_producer(0), _consumer(1, "s2", cross_iter_depends_on=[("X", -1)])],
        "cross_iter(Δ=0)",
        0,
    ),
}
