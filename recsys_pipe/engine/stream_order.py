"""Which event waits stream order already implies: found once per task graph, by replaying its
iterations with vector clocks.

A consumer on stream S waits on the event its producer recorded on stream P. That wait orders
nothing new when S is already ordered after that point of P: an earlier wait on S (of this
task or an earlier one) was on an event of P recorded later, or on an event of a third stream
recorded after that stream had waited on P (transitively). The plan runner skips such waits
in the steady state.

How it is decided. Each stream's knowledge is a vector clock: for every stream, the latest of
its operations known to be complete before the stream's next work, a position `(iteration,
index)`; an event carries its stream's clock at the record. `implied_waits` replays the plan
runner's schedule from a fresh ring (the prefill, then full iterations) with the guaranteed
clocks: an event wait joins the event's clock; the prefill fallback `wait_stream(P)` joins only
P's clock after the last task on P that must have been submitted before the wait on every
executor (an earlier iteration, an earlier group, or an ancestor through the CPU edges: the
threaded executor may not have submitted the rest yet). A wait is implied when its stream's
clock, joined with the clocks of the task's other waits that are kept, dominates the event's
clock componentwise: skipping it then changes no clock at all, so every later decision (made on
the same clocks) and every declared dependency (a wait or a dominated one) still holds. The
replay stops once the state at the start of an iteration, relative to the iteration, is the
state at the start of the previous one: from there on every iteration decides the same, and
`ImpliedWaits.from_iteration` says where. Knowledge older than the ring (more than L iterations
back) is forgotten: no wait ever looks that far back, so the state is finite and the replay ends.

Only the steady state skips (every task fires, every event exists), and only after a prefill
like the replayed one; the plan runner checks both (`PlanRunner`), and waits in full otherwise.
`check_happens_before` (recsys_pipe.engine.testing) proves the result on recorded runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from recsys_pipe.engine.deps import DependencyGraph, cpu_edges
from recsys_pipe.engine.task import Task

__all__ = ["ImpliedWaits", "implied_waits"]

#: a position on a stream: (internal iteration, index of the task's work on that stream within it)
Position = tuple[int, int]
Clock = dict[str, Position]

#: iterations replayed after the prefill before giving up on a fixed point (then nothing is skipped)
MAX_STEADY_ITERATIONS = 64


@dataclass(frozen=True)
class ImpliedWaits:
    """The outcome of `implied_waits`.

    Attributes:
        implied: (consumer task, index into `graph.event_waits[consumer]`) of every wait the
            steady state may skip.
        from_iteration: the first internal iteration after a reset from which they may be skipped
            (every earlier one waits in full); None when no fixed point was found (skip nothing).
    """

    implied: frozenset[tuple[str, int]]
    from_iteration: int | None

    def kept(self, graph: DependencyGraph, task: str) -> tuple[int, ...]:
        """Indices of `task`'s waits the steady state still makes."""
        return tuple(i for i in range(len(graph.event_waits[task])) if (task, i) not in self.implied)


def implied_waits(graph: DependencyGraph, max_steady: int = MAX_STEADY_ITERATIONS) -> ImpliedWaits:
    """Replay `graph`'s schedule (see the module docstring) and return the waits its steady state
    may skip, and from which internal iteration."""
    replay = _Replay(graph)
    L = graph.max_lookahead
    for i in range(L):  # the prefill: batch i pulled, the tasks of lookahead >= L - i fire
        replay.iteration(i, steady=False)
    previous = None
    for i in range(L, L + max_steady):
        state = replay.state(i)
        if state == previous:
            return ImpliedWaits(frozenset(replay.iteration(i, steady=True)), i - 1)
        previous = state
        replay.iteration(i, steady=True)
    return ImpliedWaits(frozenset(), None)


def _dominates(a: Mapping[str, Position], b: Mapping[str, Position]) -> bool:
    return all(a.get(s, (-1, -1)) >= p for s, p in b.items())


def _join(into: Clock, other: Mapping[str, Position]) -> None:
    for s, p in other.items():
        if p > into.get(s, (-1, -1)):
            into[s] = p


class _Replay:
    """The guaranteed clocks of every stream and ring event while the schedule is replayed."""

    def __init__(self, graph: DependencyGraph):
        self.graph = graph
        self.L = graph.max_lookahead
        self.records = {w.producer for waits in graph.event_waits.values() for w in waits}
        self.clock: dict[str, Clock] = {t.stream: {} for t in graph.order}
        self.end_clock: dict[str, Clock] = {s: {} for s in self.clock}  # at the end of the last iteration
        self.ring: list[dict[str, Clock]] = [{} for _ in range(self.L + 1)]

    def state(self, i: int) -> tuple:
        """The replay's state at the start of iteration `i`, relative to `i` (for the fixed point)."""

        def rel(clock: Mapping[str, Position]) -> tuple:
            return tuple(sorted((s, (it - i, k)) for s, (it, k) in clock.items()))

        return (
            tuple(sorted((s, rel(c)) for s, c in self.clock.items())),
            tuple(sorted((s, rel(c)) for s, c in self.end_clock.items())),
            tuple(tuple(sorted((p, rel(c)) for p, c in store.items())) for store in self.ring),
        )

    def iteration(self, i: int, steady: bool) -> set[tuple[str, int]]:
        """Replay iteration `i`; returns the waits found implied in it."""
        self._forget(i - self.L)
        implied: set[tuple[str, int]] = set()
        after: dict[str, Clock] = {}  # the clock of a task's stream after its work, this iteration
        index: dict[str, int] = {}  # work items per stream so far in this iteration
        earlier: list[Task] = []  # tasks of the earlier groups of this iteration
        for group in self.graph.group_orders:
            firing = [t for t in group if steady or i >= self.L - t.lookahead]
            ancestors = _ancestors(self.graph, firing)
            for task in firing:
                before = earlier + [t for t in firing if t.name in ancestors[task.name]]
                implied |= self._task(task, i, before, after, index)
            earlier += firing
        self.end_clock = {s: dict(c) for s, c in self.clock.items()}
        self.ring = self.ring[1:] + [{}]
        return implied

    def _task(
        self, task: Task, i: int, before: Sequence[Task], after: dict[str, Clock], index: dict[str, int]
    ) -> set[tuple[str, int]]:
        """One task's waits, work and record; the waits of it found implied."""
        clock = self.clock[task.stream]
        candidates: list[tuple[int, Clock]] = []
        for w, wait in enumerate(self.graph.event_waits[task.name]):
            event = self.ring[wait.slot_offset].get(wait.producer)
            if event is not None:
                candidates.append((w, event))
                continue
            # the prefill fallback waits for the producer's stream as a whole: at least up to the last
            # task on it that every executor has submitted by now
            last = next((t for t in reversed(before) if t.stream == wait.producer_stream), None)
            _join(clock, after[last.name] if last is not None else self.end_clock[wait.producer_stream])
        implied = set()
        for w, event in list(candidates):
            covered = dict(clock)
            for other, other_event in candidates:
                if other != w:
                    _join(covered, other_event)
            if _dominates(covered, event):
                candidates.remove((w, event))
                implied.add((task.name, w))
        for _, event in candidates:
            _join(clock, event)
        k = index.get(task.stream, 0)
        index[task.stream] = k + 1
        clock[task.stream] = (i, k)
        after[task.name] = dict(clock)
        if task.name in self.records:
            self.ring[task.lookahead][task.name] = dict(clock)
        return implied

    def _forget(self, oldest: int) -> None:
        """Drop knowledge of positions before iteration `oldest`: no wait looks back that far."""
        for clock in (*self.clock.values(), *self.end_clock.values(), *(c for s in self.ring for c in s.values())):
            for s in [s for s, (it, _) in clock.items() if it < oldest]:
                del clock[s]


def _ancestors(graph: DependencyGraph, firing: Sequence[Task]) -> dict[str, set[str]]:
    """For each firing task, the firing tasks of its group that precede it through the CPU
    edges (declared and same-stream), which every executor runs (submits) before it."""
    preds: dict[str, set[str]] = {t.name: set() for t in firing}
    for edge in cpu_edges(graph, firing):
        preds[edge.consumer].add(edge.producer)
    closure: dict[str, set[str]] = {}
    for t in firing:  # topological order: predecessors are closed first
        found = set(preds[t.name])
        for p in preds[t.name]:
            found |= closure[p]
        closure[t.name] = found
    return closure
