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


# -- analysis: one function per rule -----------------------------------------------------------
#
# `_analyse` applies the rules in this order and collects every problem, so that an invalid task
# graph is reported in one error: (1) task names are unique; (2) lookaheads and slot offsets are
# >= 0; (3) every stream is declared (and in the pool); (4) a slot has one writer, never the
# engine's `batch_cpu`; (5) every read resolves to a writer at the same or a deeper offset; (6)
# every task a dependency field names exists, and the dependency is not a future read; (7) the
# in-iteration graph of each group is acyclic; (8) a cross-stream wait finds its event in the
# ring, at one offset per (consumer, producer) pair; (9) an in-iteration edge never points to a
# later group. Problems come out task by task, in declaration order, as the rules meet them.


@dataclass(frozen=True)
class _Declared:
    """What the dependency rules look names up in: the tasks by name, the writer of each slot and
    the known names as an error message lists them."""

    by_name: Mapping[str, Task]
    writers: Mapping[DataSlot, str]
    known: str


def _analyse(
    task_graph: TaskGraph, pool: StreamPool | None
) -> tuple[list[Problem], tuple[Dependency, ...], tuple[tuple[Task, ...], ...]]:
    """Every rule above applied to `task_graph`: the problems (all of them), the resolved
    dependencies and, when there is no problem, each group's topological order (else `()`)."""
    by_name, group_of, problems = _unique_tasks(task_graph)
    if problems:
        return problems, (), ()
    tasks = tuple(by_name.values())
    for t in tasks:  # rules 2 and 3 (rule 2 is re-checked here: tasks are mutable objects)
        problems += _non_negative_offsets(t)
        problems += _declared_stream(t, task_graph, pool)
    writers, writer_problems = _slot_writers(tasks)
    problems += writer_problems
    declared = _Declared(by_name, writers, ", ".join(by_name))
    deps: list[Dependency] = []
    for c in tasks:  # rules 5 and 6, field by field of each consumer
        for resolve in (_slot_reads, _depends_on, _cross_iter_depends_on, _same_progress_sync):
            found, field_problems = resolve(c, declared)
            deps += found
            problems += field_problems
    problems += _cross_stream_waits(deps, by_name)
    problems += _group_order(deps, group_of)
    if problems:
        return problems, tuple(deps), ()
    group_orders, cycle_problem = _sort_groups(task_graph, deps)
    if cycle_problem is not None:
        return [cycle_problem], tuple(deps), ()
    return [], tuple(deps), group_orders


def _unique_tasks(task_graph: TaskGraph) -> tuple[dict[str, Task], dict[str, int], list[Problem]]:
    """Rule 1: every member of a group is a `Task`, and no two tasks share a name (a name is how
    slots, dependencies, thread maps and errors refer to a task). Returns the tasks by name in
    declaration order, the group index of each, and the problems."""
    problems: list[Problem] = []
    by_name: dict[str, Task] = {}
    group_of: dict[str, int] = {}
    for s, group in enumerate(task_graph.groups):
        for t in group.tasks:
            if not isinstance(t, Task):
                problems.append(Problem(f"group {s} holds {t!r}, which is not a Task"))
                continue
            if t.name in by_name:
                problems.append(
                    Problem("task name is used by more than one task; names must be unique", t.name, "name")
                )
                continue
            by_name[t.name] = t
            group_of[t.name] = s
    return by_name, group_of, problems


def _non_negative_offsets(t: Task) -> list[Problem]:
    """Rule 2: a lookahead and every slot offset are >= 0: an offset counts batches ahead of the
    oldest in flight, and the ring holds no batch behind it."""
    problems = []
    if t.lookahead < 0:
        problems.append(Problem(f"must be >= 0, got {t.lookahead}", t.name, "lookahead"))
    for field_name in ("reads", "writes"):
        for i, slot in enumerate(getattr(t, field_name)):
            if slot.batch_offset < 0:
                problems.append(Problem(f"slot offsets must be >= 0, got {slot}", t.name, field_name, i))
    return problems


def _declared_stream(t: Task, task_graph: TaskGraph, pool: StreamPool | None) -> list[Problem]:
    """Rule 3: a task's stream is one the task graph declares and, when the plan runner's pool is
    known, one the pool has: a task never runs on a stream nobody created."""
    if t.stream not in task_graph.stream_slots:
        declared = ", ".join(task_graph.stream_slots)
        return [Problem(f"stream '{t.stream}' is not declared (declared: {declared})", t.name, "stream")]
    if pool is not None and t.stream not in pool:
        names = ", ".join(pool.names)
        return [Problem(f"stream '{t.stream}' is not in the stream pool (pool has: {names})", t.name, "stream")]
    return []


def _slot_writers(tasks: Sequence[Task]) -> tuple[dict[DataSlot, str], list[Problem]]:
    """Rule 4: each slot (name and offset) has at most one writer, so a read has one producer to
    wait for, and no task writes `batch_cpu`, where the engine puts the pulled batch. Returns the
    writer of each slot (the first, where several claim one) and the problems."""
    writers: dict[DataSlot, str] = {}
    problems = []
    for t in tasks:
        for i, slot in enumerate(t.writes):
            if slot.name == BATCH_CPU:
                message = f"slot '{BATCH_CPU}' is reserved: the engine writes the pulled batch there"
                problems.append(Problem(message, t.name, "writes", i))
            elif slot in writers:
                message = f"slot {slot} is already written by '{writers[slot]}'; each slot has at most one writer"
                problems.append(Problem(message, t.name, "writes", i))
            else:
                writers[slot] = t.name
    return writers, problems


def _slot_reads(c: Task, declared: _Declared) -> tuple[list[Dependency], list[Problem]]:
    """Rule 5: every slot `c` reads (but `batch_cpu`, the engine's) resolves to a writer. A value
    written at offset k is visible at offsets <= k (the ring rotates it down), so the producer is
    the writer of the slot's name at the smallest offset >= the read's; Δ = k - j. A task that
    reads back only what it wrote itself depends on nobody."""
    deps, problems = [], []
    for i, slot in enumerate(c.reads):
        if slot.name == BATCH_CPU:
            continue
        candidates = sorted((w.batch_offset, name) for w, name in declared.writers.items() if w.name == slot.name)
        usable = [(k, name) for k, name in candidates if k >= slot.batch_offset and name != c.name]
        if usable:
            k, producer = usable[0]
            delta = k - slot.batch_offset
            lookahead = declared.by_name[producer].lookahead
            deps.append(Dependency(producer, c.name, "slot", "reads", i, delta, lookahead - delta))
        elif candidates and all(name == c.name for _, name in candidates):
            continue  # a task reading back what it wrote itself: no dependency
        elif candidates:
            found = ", ".join(f"'{n}' at offset {k}" for k, n in candidates)
            message = (
                f"future read: slot '{slot.name}' is read at offset {slot.batch_offset} but only "
                f"written at a smaller offset ({found}); a value written at offset k is visible "
                f"at offsets <= k"
            )
            problems.append(Problem(message, c.name, "reads", i))
        else:
            problems.append(Problem(f"no task writes slot '{slot.name}'", c.name, "reads", i))
    return deps, problems


def _named_task(declared: _Declared, name: str, c: Task, field_name: str, index: int) -> Task | Problem:
    """Rule 6, first half: a dependency field names a task that exists (the problem otherwise)."""
    task = declared.by_name.get(name)
    if task is None:
        return Problem(f"unknown task '{name}' (known: {declared.known})", c.name, field_name, index)
    return task


def _depends_on(c: Task, declared: _Declared) -> tuple[list[Dependency], list[Problem]]:
    """Rule 6 for `depends_on: [X]` (X processed the same batch): X exists and has a lookahead >=
    C's, or it has not reached C's batch yet (a future read); Δ = X.la - C.la, event at C.la."""
    deps, problems = [], []
    for i, name in enumerate(c.depends_on):
        x = _named_task(declared, name, c, "depends_on", i)
        if isinstance(x, Problem):
            problems.append(x)
        elif x.lookahead < c.lookahead:
            message = (
                f"future read: '{name}' has lookahead {x.lookahead} < this task's {c.lookahead}, so it "
                f"has not processed this batch yet; depends_on needs the producer's lookahead >= the "
                f"consumer's (use cross_iter_depends_on for an earlier batch)"
            )
            problems.append(Problem(message, c.name, "depends_on", i))
        else:
            delta = x.lookahead - c.lookahead
            deps.append(Dependency(name, c.name, "depends_on", "depends_on", i, delta, c.lookahead))
    return deps, problems


def _cross_iter_depends_on(c: Task, declared: _Declared) -> tuple[list[Dependency], list[Problem]]:
    """Rule 6 for `cross_iter_depends_on: [[X, -N]]` (X processed batch K-N when C processes K):
    X exists and Δ = X.la + N - C.la >= 0; the event is at C.la - N, or at X.la when Δ = 0 (then
    the edge acts as `same_progress_sync`)."""
    deps, problems = [], []
    for i, (name, offset) in enumerate(c.cross_iter_depends_on):
        x = _named_task(declared, name, c, "cross_iter_depends_on", i)
        if isinstance(x, Problem):
            problems.append(x)
            continue
        n = -offset
        delta = x.lookahead + n - c.lookahead
        if delta < 0:
            message = (
                f"future read: ('{name}', {offset}) gives Δ = {x.lookahead} + {n} - {c.lookahead} = {delta} "
                f"< 0: "
                f"'{name}' has not processed batch K-{n} when this task processes batch K"
            )
            problems.append(Problem(message, c.name, "cross_iter_depends_on", i))
            continue
        slot_offset = x.lookahead if delta == 0 else c.lookahead - n
        deps.append(Dependency(name, c.name, "cross_iter_depends_on", "cross_iter_depends_on", i, delta, slot_offset))
    return deps, problems


def _same_progress_sync(c: Task, declared: _Declared) -> tuple[list[Dependency], list[Problem]]:
    """Rule 6 for `same_progress_sync: [X]` (X's work of this iteration is done first): X exists;
    always legal, Δ = 0, the event at X.la."""
    deps, problems = [], []
    for i, name in enumerate(c.same_progress_sync):
        x = _named_task(declared, name, c, "same_progress_sync", i)
        if isinstance(x, Problem):
            problems.append(x)
        else:
            deps.append(Dependency(name, c.name, "same_progress_sync", "same_progress_sync", i, 0, x.lookahead))
    return deps, problems


def _cross_stream_waits(deps: Sequence[Dependency], by_name: Mapping[str, Task]) -> list[Problem]:
    """Rule 8: a consumer on another stream than its producer waits on the producer's event, so
    that event must still be in the ring (offset >= 0: Δ not beyond the producer's lookahead),
    and all of a (consumer, producer) pair's declarations must look it up at one offset: the
    engine makes one wait per pair. Same-stream dependencies need no event (FIFO)."""
    problems = []
    pair_offsets: dict[tuple[str, str], Dependency] = {}
    for d in deps:
        x, c = by_name[d.producer], by_name[d.consumer]
        if x.stream == c.stream:
            continue
        if d.slot_offset < 0:
            message = (
                f"cross-stream wait on '{d.producer}' (stream '{x.stream}') would look up its event at ring "
                f"offset {d.slot_offset} (Δ = {d.delta}), which has rotated out of the ring; put both tasks "
                f"on one stream or raise this task's lookahead"
            )
            problems.append(Problem(message, c.name, d.field, d.index))
            continue
        first = pair_offsets.setdefault((d.producer, d.consumer), d)
        if first.slot_offset != d.slot_offset:
            message = (
                f"'{d.producer}' is waited on twice with different ring offsets ({first.field} gives "
                f"{first.slot_offset}, {d.field} gives {d.slot_offset}); at most one cross-stream wait per "
                f"(consumer, producer) pair"
            )
            problems.append(Problem(message, c.name, d.field, d.index))
    return problems


def _group_order(deps: Sequence[Dependency], group_of: Mapping[str, int]) -> list[Problem]:
    """Rule 9: groups run one after another within an iteration, so an in-iteration edge (Δ = 0)
    may not point from a later group to an earlier one."""
    problems = []
    for d in deps:
        if d.in_iteration and group_of[d.producer] > group_of[d.consumer]:
            message = (
                f"'{d.producer}' runs in group {group_of[d.producer]}, after this task's group "
                f"{group_of[d.consumer]}, but must run before it in the same iteration"
            )
            problems.append(Problem(message, d.consumer, d.field, d.index))
    return problems


def _sort_groups(task_graph: TaskGraph, deps: list[Dependency]) -> tuple[tuple[tuple[Task, ...], ...], Problem | None]:
    """Rule 7: each group's in-iteration edges (Δ = 0) form no cycle. Kahn's algorithm orders the
    group, declaration order breaking ties (so the order is the same on every rank); a cycle is
    the problem, reported at its first edge as `cyclic dependency: a -> b -> a`."""
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
        if len(order) < len(names):
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
