"""Compile a task graph's declarations into execution order, CPU edges and stream-event waits.

Every dependency reduces to one question: between the producer recording its completion event
(always into `ring.at(producer.lookahead)` of its own iteration) and the consumer running, how
many times did the ring advance (Δ)? Δ = 0 means same iteration: a topological edge, and the
event sits at `producer.lookahead`. Δ ≥ 1 means an earlier iteration: no in-iteration edge, and
the event has rotated down to `producer.lookahead - Δ`; below 0 it has left the ring.

| declaration on consumer C          | Δ                    | slot_offset           |
|------------------------------------|----------------------|-----------------------|
| reads (s, j) written by X at (s, k)| k - j                | X.la - (k - j) (= j)  |
| depends_on X                       | X.la - C.la          | C.la                  |
| cross_iter_depends_on (X, -N)      | X.la + N - C.la      | C.la - N, or X.la at Δ=0 |
| same_progress_sync X               | 0                    | X.la                  |
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from recsys_pipe.engine.errors import DependencyCycleError, Problem, TaskGraphValidationError
from recsys_pipe.engine.streams import StreamPool
from recsys_pipe.engine.task import BATCH_CPU, DataSlot, Task
from recsys_pipe.engine.task_graph import TaskGraph


@dataclass(frozen=True)
class Dependency:
    """One resolved producer -> consumer declaration."""

    producer: str
    consumer: str
    kind: str  # "slot" | "depends_on" | "cross_iter_depends_on" | "same_progress_sync"
    field: str  # consumer's field that declared it
    index: int  # item index in that field
    delta: int  # ring advances between the producer's run and the consumer's run
    slot_offset: int  # where the consumer finds the producer's event

    @property
    def in_iteration(self) -> bool:
        """Same internal iteration: ordered by the topological sort (and a CPU edge)."""
        return self.delta == 0

    @property
    def edge_kind(self) -> str:
        """The kind as printed: a `cross_iter_depends_on` with Δ = 0 acts as `same_progress_sync` and says so."""
        if self.kind == "cross_iter_depends_on" and self.delta == 0:
            return "cross_iter(Δ=0)"
        return self.kind


@dataclass(frozen=True)
class Edge:
    """An in-iteration ordering edge: producer runs before consumer in the same iteration."""

    producer: str
    consumer: str
    kind: str


@dataclass(frozen=True)
class EventWait:
    """Before running, the consumer's stream waits on the event `producer` recorded in
    `ring.at(slot_offset)` (or, if none was recorded yet, on `producer_stream` as a whole)."""

    producer: str
    producer_stream: str
    slot_offset: int


@dataclass(frozen=True)
class DependencyGraph:
    """A validated task_graph, compiled."""

    task_graph: TaskGraph
    order: tuple[Task, ...]
    group_orders: tuple[tuple[Task, ...], ...]
    dependencies: tuple[Dependency, ...]
    edges: tuple[Edge, ...]
    event_waits: Mapping[str, tuple[EventWait, ...]] = field(default_factory=dict)

    @property
    def max_lookahead(self) -> int:
        """The largest lookahead of any task (the task graph's)."""
        return self.task_graph.max_lookahead

    @property
    def in_flight_batches(self) -> int:
        """How many batches are in flight, `max_lookahead + 1`: the ring's size."""
        return self.max_lookahead + 1

    def task(self, name: str) -> Task:
        """The task called `name` (KeyError when the task graph has none)."""
        for t in self.order:
            if t.name == name:
                return t
        raise KeyError(name)


def compile_dependencies(task_graph: TaskGraph, stream_pool: StreamPool | None = None) -> DependencyGraph:
    """Validate `task_graph` (all rules) and compile it.

    Args:
        task_graph: the tasks and streams of one iteration.
        stream_pool: the streams the plan runner will run on; when given, every stream a task names
            must be in it.

    Returns:
        The `DependencyGraph`: the topological order and every resolved dependency with its ring
        offset. Raises TaskGraphValidationError listing every problem at once."""
    problems, deps, group_orders = _analyse(task_graph, stream_pool)
    if problems:
        error = (
            DependencyCycleError
            if all(p.message.startswith("cyclic dependency") for p in problems)
            else TaskGraphValidationError
        )
        raise error(problems)
    tasks = {t.name: t for t in task_graph.tasks}
    waits: dict[str, list[EventWait]] = {t.name: [] for t in task_graph.tasks}
    for d in deps:
        producer = tasks[d.producer]
        if producer.stream != tasks[d.consumer].stream:
            wait = EventWait(d.producer, producer.stream, d.slot_offset)
            if wait not in waits[d.consumer]:
                waits[d.consumer].append(wait)
    order = tuple(t for group in group_orders for t in group)
    edges = tuple(dict.fromkeys(Edge(d.producer, d.consumer, d.edge_kind) for d in deps if d.in_iteration))
    return DependencyGraph(
        task_graph=task_graph,
        order=order,
        group_orders=group_orders,
        dependencies=deps,
        edges=edges,
        event_waits=MappingProxyType({k: tuple(v) for k, v in waits.items()}),
    )


def cpu_edges(graph: DependencyGraph, tasks: Sequence[Task] | None = None) -> tuple[Edge, ...]:
    """Edges that order tasks of one iteration on the CPU, among `tasks` (those firing, in
    topological order; default all): the declared in-iteration edges, then same-stream FIFO
    (the previous task on the same stream), which keeps a stream's submission order when a
    thread map splits its tasks over threads. The threaded executor enforces these across
    threads (plus the order of `nccl` tasks); `recsys-plan` prints them."""
    tasks = graph.order if tasks is None else tasks
    names = {t.name for t in tasks}
    edges = [e for e in graph.edges if e.producer in names and e.consumer in names]
    declared = {(e.producer, e.consumer) for e in edges}
    last_on_stream: dict[str, str] = {}
    for t in tasks:
        previous = last_on_stream.get(t.stream)
        if previous is not None and (previous, t.name) not in declared:
            edges.append(Edge(previous, t.name, "stream_fifo"))
        last_on_stream[t.stream] = t.name
    return tuple(edges)


# -- analysis -----------------------------------------------------------------------------------


def _analyse(task_graph: TaskGraph, pool: StreamPool | None):
    problems: list[Problem] = []
    tasks = task_graph.tasks
    by_name: dict[str, Task] = {}
    group_of: dict[str, int] = {}
    for s, group in enumerate(task_graph.groups):
        for t in group.tasks:
            if not isinstance(t, Task):
                problems.append(Problem(f"group {s} holds {t!r}, which is not a Task"))
                continue
            if t.name in by_name:  # rule 1
                problems.append(
                    Problem("task name is used by more than one task; names must be unique", t.name, "name")
                )
                continue
            by_name[t.name] = t
            group_of[t.name] = s
    if problems:
        return problems, (), ()
    tasks = tuple(by_name.values())

    for t in tasks:  # rules 2 and 3 (rule 2 is re-checked: tasks are mutable objects)
        if t.lookahead < 0:
            problems.append(Problem(f"must be >= 0, got {t.lookahead}", t.name, "lookahead"))
        for field_name in ("reads", "writes"):
            for i, slot in enumerate(getattr(t, field_name)):
                if slot.batch_offset < 0:
                    problems.append(Problem(f"slot offsets must be >= 0, got {slot}", t.name, field_name, i))
        if t.stream not in task_graph.stream_slots:
            problems.append(
                Problem(
                    f"stream '{t.stream}' is not declared (declared: {', '.join(task_graph.stream_slots)})",
                    t.name,
                    "stream",
                )
            )
        elif pool is not None and t.stream not in pool:
            problems.append(
                Problem(
                    f"stream '{t.stream}' is not in the stream pool (pool has: {', '.join(pool.names)})",
                    t.name,
                    "stream",
                )
            )

    writers: dict[DataSlot, str] = {}
    for t in tasks:  # rule 4
        for i, slot in enumerate(t.writes):
            if slot.name == BATCH_CPU:
                problems.append(
                    Problem(
                        f"slot '{BATCH_CPU}' is reserved: the engine writes the pulled batch there", t.name, "writes", i
                    )
                )
            elif slot in writers:
                problems.append(
                    Problem(
                        f"slot {slot} is already written by '{writers[slot]}'; each slot has at most one writer",
                        t.name,
                        "writes",
                        i,
                    )
                )
            else:
                writers[slot] = t.name

    deps: list[Dependency] = []
    known = ", ".join(by_name)
    for c in tasks:
        for i, slot in enumerate(c.reads):  # rule 5
            if slot.name == BATCH_CPU:
                continue
            candidates = sorted((w.batch_offset, name) for w, name in writers.items() if w.name == slot.name)
            usable = [(k, name) for k, name in candidates if k >= slot.batch_offset and name != c.name]
            if not usable:
                if any(name == c.name for _, name in candidates) and not [k for k, n in candidates if n != c.name]:
                    continue  # a task reading back what it wrote itself: no dependency
                if candidates:
                    found = ", ".join(f"'{n}' at offset {k}" for k, n in candidates)
                    msg = (
                        f"future read: slot '{slot.name}' is read at offset {slot.batch_offset} but only "
                        f"written at a smaller offset ({found}); a value written at offset k is visible "
                        f"at offsets <= k"
                    )
                else:
                    msg = f"no task writes slot '{slot.name}'"
                problems.append(Problem(msg, c.name, "reads", i))
                continue
            k, producer = usable[0]
            x = by_name[producer]
            delta = k - slot.batch_offset
            deps.append(Dependency(producer, c.name, "slot", "reads", i, delta, x.lookahead - delta))

        for i, name in enumerate(c.depends_on):
            x = _lookup(by_name, name, c, "depends_on", i, known, problems)
            if x is None:
                continue
            if x.lookahead < c.lookahead:
                problems.append(
                    Problem(
                        f"future read: '{name}' has lookahead {x.lookahead} < this task's {c.lookahead}, so it "
                        f"has not processed this batch yet; depends_on needs the producer's lookahead >= the "
                        f"consumer's (use cross_iter_depends_on for an earlier batch)",
                        c.name,
                        "depends_on",
                        i,
                    )
                )
                continue
            deps.append(Dependency(name, c.name, "depends_on", "depends_on", i, x.lookahead - c.lookahead, c.lookahead))

        for i, (name, offset) in enumerate(c.cross_iter_depends_on):
            x = _lookup(by_name, name, c, "cross_iter_depends_on", i, known, problems)
            if x is None:
                continue
            n = -offset
            delta = x.lookahead + n - c.lookahead
            if delta < 0:
                problems.append(
                    Problem(
                        f"future read: ('{name}', {offset}) gives Δ = {x.lookahead} + {n} - {c.lookahead} = {delta} "
                        f"< 0: "
                        f"'{name}' has not processed batch K-{n} when this task processes batch K",
                        c.name,
                        "cross_iter_depends_on",
                        i,
                    )
                )
                continue
            slot_offset = x.lookahead if delta == 0 else c.lookahead - n
            deps.append(
                Dependency(name, c.name, "cross_iter_depends_on", "cross_iter_depends_on", i, delta, slot_offset)
            )

        for i, name in enumerate(c.same_progress_sync):
            x = _lookup(by_name, name, c, "same_progress_sync", i, known, problems)
            if x is None:
                continue
            deps.append(Dependency(name, c.name, "same_progress_sync", "same_progress_sync", i, 0, x.lookahead))

    pair_offsets: dict[tuple[str, str], Dependency] = {}
    for d in deps:  # cross-stream lookups must stay in the ring; rule 8
        x, c = by_name[d.producer], by_name[d.consumer]
        if x.stream == c.stream:
            continue
        if d.slot_offset < 0:
            problems.append(
                Problem(
                    f"cross-stream wait on '{d.producer}' (stream '{x.stream}') would look up its event at ring "
                    f"offset {d.slot_offset} (Δ = {d.delta}), which has rotated out of the ring; put both tasks "
                    f"on one stream or raise this task's lookahead",
                    c.name,
                    d.field,
                    d.index,
                )
            )
            continue
        first = pair_offsets.setdefault((d.producer, d.consumer), d)
        if first.slot_offset != d.slot_offset:
            problems.append(
                Problem(
                    f"'{d.producer}' is waited on twice with different ring offsets ({first.field} gives "
                    f"{first.slot_offset}, {d.field} gives {d.slot_offset}); at most one cross-stream wait per "
                    f"(consumer, producer) pair",
                    c.name,
                    d.field,
                    d.index,
                )
            )

    for d in deps:  # groups run in order: an in-iteration edge may not point backwards
        if d.in_iteration and group_of[d.producer] > group_of[d.consumer]:
            problems.append(
                Problem(
                    f"'{d.producer}' runs in group {group_of[d.producer]}, after this task's group "
                    f"{group_of[d.consumer]}, but must run before it in the same iteration",
                    d.consumer,
                    d.field,
                    d.index,
                )
            )

    if problems:
        return problems, tuple(deps), ()
    group_orders, cycle_problem = _sort_groups(task_graph, deps)
    if cycle_problem is not None:
        return [cycle_problem], tuple(deps), ()
    return [], tuple(deps), group_orders


def _lookup(by_name, name, consumer, field_name, index, known, problems) -> Task | None:
    task = by_name.get(name)
    if task is None:  # rule 6
        problems.append(Problem(f"unknown task '{name}' (known: {known})", consumer.name, field_name, index))
    return task


def _sort_groups(task_graph: TaskGraph, deps: list[Dependency]):
    in_iteration = [d for d in deps if d.in_iteration]
    orders = []
    for group in task_graph.groups:
        names = [t.name for t in group.tasks]
        position = {n: i for i, n in enumerate(names)}
        succ: dict[str, list[str]] = {n: [] for n in names}
        indegree = dict.fromkeys(names, 0)
        for d in in_iteration:
            if d.producer in position and d.consumer in position and d.consumer not in succ[d.producer]:
                succ[d.producer].append(d.consumer)
                indegree[d.consumer] += 1
        ready = [position[n] for n in names if indegree[n] == 0]
        heapq.heapify(ready)
        order: list[str] = []
        while ready:
            name = names[heapq.heappop(ready)]
            order.append(name)
            for nxt in succ[name]:
                indegree[nxt] -= 1
                if indegree[nxt] == 0:
                    heapq.heappush(ready, position[nxt])
        if len(order) < len(names):  # rule 7
            remaining = {n for n in names if indegree[n] > 0}
            cycle = _find_cycle(remaining, succ, names)
            first_edge = next(d for d in in_iteration if d.producer == cycle[0] and d.consumer == cycle[1])
            message = "cyclic dependency: " + " -> ".join(cycle)
            return (), Problem(message, first_edge.consumer, first_edge.field, first_edge.index)
        orders.append(tuple(group.tasks[position[n]] for n in order))
    return tuple(orders), None


def _find_cycle(remaining: set[str], succ: dict[str, list[str]], names: list[str]) -> list[str]:
    """A cycle among the nodes Kahn's algorithm could not place, as a closed path.

    Each such node still has a predecessor among them, so walking predecessors must loop.
    """
    preds = {n: [p for p in names if p in remaining and n in succ[p]] for n in remaining}
    node = next(n for n in names if n in remaining)
    seen: dict[str, int] = {}
    path: list[str] = []
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = preds[node][0]
    cycle = path[seen[node] :][::-1]  # walked backwards: reverse into producer -> consumer order
    first = min(range(len(cycle)), key=lambda i: names.index(cycle[i]))  # start at the earliest declared
    cycle = cycle[first:] + cycle[:first]
    return cycle + [cycle[0]]
