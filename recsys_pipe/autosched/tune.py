"""Choose lookaheads, threads, streams and firing order for a plan, scored by the simulator.

`auto_assign_lookaheads` hill-climbs the lookaheads of one plan. `tune` runs a beam search over
the thread map, the stream of each task and the firing order (the order among tasks with no
dependency between them, set through declaration order, which breaks topological ties), with
`auto_assign_lookaheads` choosing the lookaheads of the most promising candidates.

Every candidate keeps the plan's meaning: all declared dependencies stay (only lookaheads,
streams, threads and declaration order change, and the engine's validator must accept the
result), the relative order of NCCL tasks is unchanged (so every rank still issues collectives
in one order), the frozen tasks stay at lookahead 0 on the default stream (their numerics are
the reference), at most `max_threads` threads and `max_in_flight` batches in flight.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from recsys_pipe.autosched.costs import CostModel
from recsys_pipe.autosched.simulator import ThreadMapSpec, load_costs, resolve_threads, simulate
from recsys_pipe.engine import (
    DEFAULT_STREAM,
    DependencyGraph,
    Task,
    TaskGraph,
    TaskGraphValidationError,
    TaskGroup,
    compile_dependencies,
)

__all__ = ["FROZEN_TASKS", "TaskChange", "TuneResult", "auto_assign_lookaheads", "tune"]

#: Tasks whose lookahead (0) and stream (default) are never changed: the training step itself.
FROZEN_TASKS = frozenset({"forward", "backward", "finalize_model_grads", "optimizer_step"})
#: relative margin below which two predicted step times count as equal
_TIE = 1e-9


@dataclass(frozen=True)
class TaskChange:
    """How one task differs between the input plan and the tuned one: (before, after) pairs.
    `position` is the task's index in the topological order."""

    task: str
    thread: tuple[str, str]
    stream: tuple[str, str]
    lookahead: tuple[int, int]
    position: tuple[int, int]

    @property
    def changed(self) -> bool:
        """Whether the tuner changed anything about the task (thread, stream, lookahead or position)."""
        return any(a != b for a, b in (self.thread, self.stream, self.lookahead, self.position))


@dataclass(frozen=True)
class TuneResult:
    """The best plan found.

    Attributes:
        task_graph: the tuned plan (a new engine TaskGraph; tasks rebuilt with `Task.replace`).
        thread_map: task -> thread id for the tuned plan.
        original_s / best_s: predicted step time of the input plan and of the tuned one.
        changes: one `TaskChange` per task, in the tuned topological order.
        evaluations: simulations run; stopped_early: the evaluation or time budget ran out.
    """

    task_graph: TaskGraph
    thread_map: dict[str, str]
    original_s: float
    best_s: float
    changes: tuple[TaskChange, ...]
    evaluations: int
    stopped_early: bool = False

    @property
    def speedup(self) -> float:
        """Predicted speed-up of the tuned plan, `original_s / best_s` (1.0 when the best time is 0)."""
        return self.original_s / self.best_s if self.best_s > 0 else 1.0

    def diff(self) -> str:
        """The predicted speed-up and, one line each, what changed for which task."""
        lines = [f"predicted step: {self.original_s * 1e3:.4g} ms -> {self.best_s * 1e3:.4g} ms ({self.speedup:.3f}x)"]
        for c in self.changes:
            if not c.changed:
                continue
            parts = [
                f"{label} {a} -> {b}"
                for label, (a, b) in (
                    ("thread", c.thread),
                    ("stream", c.stream),
                    ("lookahead", c.lookahead),
                    ("position", c.position),
                )
                if a != b
            ]
            lines.append(f"  {c.task}: {', '.join(parts)}")
        if len(lines) == 1:
            lines.append("  (no change)")
        return "\n".join(lines)


# -- candidates ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Candidate:
    order: tuple[tuple[str, ...], ...]  # declaration order per group
    streams: tuple[tuple[str, str], ...]  # sorted (task, stream)
    threads: tuple[tuple[str, str], ...]  # sorted (task, thread)
    lookaheads: tuple[tuple[str, int], ...]  # sorted (task, lookahead)
    score: float = field(default=float("inf"), compare=False)

    @classmethod
    def make(cls, order, streams: Mapping, threads: Mapping, lookaheads: Mapping) -> _Candidate:
        return cls(
            tuple(tuple(s) for s in order),
            tuple(sorted(streams.items())),
            tuple(sorted(threads.items())),
            tuple(sorted(lookaheads.items())),
        )

    def with_(self, **changes: Any) -> _Candidate:
        current = {
            "order": self.order,
            "streams": dict(self.streams),
            "threads": dict(self.threads),
            "lookaheads": dict(self.lookaheads),
        }
        current.update(changes)
        return _Candidate.make(**current)

    @property
    def key(self) -> tuple:
        """Identity for caching: thread ids matter only as a partition."""
        names: dict[str, int] = {}
        partition = tuple(names.setdefault(thread, len(names)) for _, thread in self.threads)
        return (self.order, self.streams, partition, self.lookaheads)


class _BudgetExhausted(Exception):
    pass


class _Evaluator:
    """Builds, checks and scores candidates, with a cache and an evaluation/time budget."""

    def __init__(
        self,
        task_graph: TaskGraph,
        costs: CostModel,
        *,
        frozen: Iterable[str],
        max_threads: int,
        max_in_flight: int,
        iterations: int,
        max_evaluations: int | None,
        deadline: float | None,
        streams: Iterable[str] = (),
    ):
        self.base = {t.name: t for t in task_graph.tasks}
        self.declared_streams = task_graph.stream_slots
        self.stream_slots = tuple(dict.fromkeys([*task_graph.stream_slots, *streams]))
        self.costs = costs
        self.frozen = frozenset(frozen) & set(self.base)
        self.max_threads = max_threads
        self.max_in_flight = max_in_flight
        self.iterations = iterations
        self.max_evaluations = max_evaluations
        self.deadline = deadline
        self.evaluations = 0
        self.best_seen: _Candidate | None = None  # best legal candidate scored so far (for early stops)
        self.origin: _Candidate | None = None  # the input plan
        self._scores: dict[tuple, float | None] = {}
        self._tasks: dict[tuple[str, str, int], Task] = {}
        self.nccl_order = tuple(t.name for t in compile_dependencies(task_graph).order if t.nccl)

    def rank(self, c: _Candidate) -> tuple:
        """Sort key: faster first; at equal speed fewer batches in flight (memory), fewer threads,
        fewer changes from the input plan, smaller lookaheads."""
        las = [la for _, la in c.lookaheads]
        return (c.score, max(las, default=0), len({t for _, t in c.threads}), self.distance(c), sum(las), repr(c.key))

    def better(self, a: _Candidate, b: _Candidate) -> bool:
        """Is `a` strictly better than `b`: faster beyond the tie margin, or as fast and simpler?"""
        if a.score < b.score * (1 - _TIE):
            return True
        if a.score > b.score * (1 + _TIE):
            return False
        return self.rank(a)[1:] < self.rank(b)[1:]

    def distance(self, c: _Candidate) -> int:
        """How many task fields (thread partition, stream, lookahead, declaration position)
        differ from the input plan."""
        if self.origin is None:
            return 0
        o = self.origin
        moved = sum(a != b for a, b in zip(o.streams + o.lookaheads, c.streams + c.lookaheads))
        ours, theirs = dict(c.threads), dict(o.threads)
        moved += sum(1 for n in ours for m in ours if n < m and (ours[n] == ours[m]) != (theirs[n] == theirs[m]))
        moved += sum(a != b for x, y in zip(o.order, c.order) for a, b in zip(x, y))
        return moved

    def task_graph(self, c: _Candidate) -> TaskGraph:
        streams, lookaheads = dict(c.streams), dict(c.lookaheads)
        groups = []
        for names in c.order:
            tasks = []
            for n in names:
                key = (n, streams[n], lookaheads[n])
                task = self._tasks.get(key)
                if task is None:
                    base = self.base[n]
                    changes = {}
                    if streams[n] != base.stream:
                        changes["stream"] = streams[n]
                    if lookaheads[n] != base.lookahead:
                        changes["lookahead"] = lookaheads[n]
                    task = self._tasks[key] = base.replace(**changes) if changes else base
                tasks.append(task)
            groups.append(TaskGroup(tuple(tasks)))
        return TaskGraph(tuple(groups), self.stream_slots)

    def violation(self, c: _Candidate) -> str | None:
        """Why `c` breaks a constraint the validator does not know about (None: it does not)."""
        streams, lookaheads = dict(c.streams), dict(c.lookaheads)
        for n in sorted(self.frozen):
            if lookaheads[n] != 0 or streams[n] != DEFAULT_STREAM:
                return f"frozen task '{n}' must stay at lookahead 0 on stream '{DEFAULT_STREAM}'"
        threads = len({t for _, t in c.threads})
        if threads > self.max_threads:
            return f"{threads} threads > max_threads={self.max_threads}"
        in_flight = max(lookaheads.values(), default=0) + 1
        if in_flight > self.max_in_flight:
            return f"{in_flight} batches in flight > max_in_flight={self.max_in_flight}"
        return None

    def graph(self, c: _Candidate) -> DependencyGraph | None:
        """The compiled candidate, or None if the validator or the NCCL order rejects it."""
        try:
            graph = compile_dependencies(self.task_graph(c))
        except TaskGraphValidationError:
            return None
        if tuple(t.name for t in graph.order if t.nccl) != self.nccl_order:
            return None
        return graph

    def score(self, c: _Candidate) -> _Candidate | None:
        """`c` with its predicted step time, or None when it is not a legal plan."""
        key = c.key
        if key in self._scores:
            s = self._scores[key]
            return None if s is None else _Candidate(c.order, c.streams, c.threads, c.lookaheads, s)
        if self.violation(c) is not None or self.graph(c) is None:
            self._scores[key] = None
            return None
        if self.max_evaluations is not None and self.evaluations >= self.max_evaluations:
            raise _BudgetExhausted
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise _BudgetExhausted
        self.evaluations += 1
        s = simulate(self.task_graph(c), self.costs, dict(c.threads), self.iterations).iteration_s
        self._scores[key] = s
        scored = _Candidate(c.order, c.streams, c.threads, c.lookaheads, s)
        if self.best_seen is None or self.better(scored, self.best_seen):
            self.best_seen = scored
        return scored


def _candidate_of(task_graph: TaskGraph, threads: Mapping[str, str]) -> _Candidate:
    tasks = task_graph.tasks
    return _Candidate.make(
        [[t.name for t in group.tasks] for group in task_graph.groups],
        {t.name: t.stream for t in tasks},
        threads,
        {t.name: t.lookahead for t in tasks},
    )


# -- lookaheads ---------------------------------------------------------------------------------


def auto_assign_lookaheads(
    task_graph: TaskGraph,
    costs: CostModel | str,
    max_in_flight: int = 5,
    *,
    thread_map: ThreadMapSpec = None,
    frozen: Iterable[str] = FROZEN_TASKS,
    iterations: int = 12,
    max_evaluations: int | None = 500,
) -> dict[str, int]:
    """Lookaheads that minimise the predicted step time; task name -> lookahead.

    Hill climbing from the plan's own lookaheads: each round tries, for every task not in
    `frozen`, one batch deeper or shallower, alone or together with every task it depends on
    (deeper) or that depends on it (shallower), and every movable task at one lookahead level
    moved together; it keeps the candidates the engine's validator
    accepts with at most `max_in_flight` batches in flight, and takes the one with the shortest
    predicted step. At equal speed it prefers fewer batches in flight and smaller lookaheads
    (less memory). It stops when no move helps, or after `max_evaluations` simulations.

    Args:
        task_graph: the plan. Tasks in `frozen` must be at lookahead 0 on the default stream.
        costs: a `CostModel`, or a path to / the text of its JSON.
        max_in_flight: at most this many batches in flight (max lookahead + 1).
        thread_map: CPU threads, as `simulate` accepts them.
        frozen: task names whose lookahead stays 0.
        iterations: batches per simulation.
        max_evaluations: simulation budget (None: unbounded).
    """
    costs = load_costs(costs)
    evaluator = _Evaluator(
        task_graph,
        costs,
        frozen=frozen,
        max_threads=len(task_graph.tasks),
        max_in_flight=max_in_flight,
        iterations=iterations,
        max_evaluations=max_evaluations,
        deadline=None,
    )
    start = _candidate_of(task_graph, resolve_threads(task_graph, costs, thread_map))
    _require_legal(evaluator, start)
    try:
        best = _climb_lookaheads(evaluator, evaluator.score(start))
    except _BudgetExhausted:
        best = evaluator.best_seen or start
    return dict(best.lookaheads)


def _require_legal(evaluator: _Evaluator, c: _Candidate) -> None:
    evaluator.origin = c
    problem = evaluator.violation(c)
    if problem is not None:
        raise ValueError(f"the input plan breaks a tuning constraint: {problem}")
    compile_dependencies(evaluator.task_graph(c))  # raises with the validator's own message
    if evaluator.graph(c) is None:
        raise ValueError("the input plan's NCCL order could not be established")


def _closure(graph: DependencyGraph, name: str, upstream: bool) -> set[str]:
    """`name` and every task it depends on (upstream) or that depends on it (downstream)."""
    links: dict[str, set[str]] = {}
    for d in graph.dependencies:
        a, b = (d.consumer, d.producer) if upstream else (d.producer, d.consumer)
        links.setdefault(a, set()).add(b)
    seen, todo = {name}, [name]
    while todo:
        for nxt in links.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _climb_lookaheads(evaluator: _Evaluator, current: _Candidate) -> _Candidate:
    limit = evaluator.max_in_flight - 1
    while True:
        graph = evaluator.graph(current)
        lookaheads = dict(current.lookaheads)
        moves: list[dict[str, int]] = []
        for level in sorted(set(lookaheads.values())):  # every movable task at one lookahead
            group = [n for n, la in lookaheads.items() if la == level and n not in evaluator.frozen]
            for step in (1, -1):
                new = dict.fromkeys(group, level + step)
                if group and 0 <= level + step <= limit:
                    moves.append(new)
        for t in graph.order:
            if t.name in evaluator.frozen:
                continue
            for step, upstream in ((1, True), (-1, False)):
                for group in ({t.name}, _closure(graph, t.name, upstream)):
                    movable = group - evaluator.frozen
                    new = {n: lookaheads[n] + step for n in movable}
                    if all(0 <= v <= limit for v in new.values()) and new not in moves:
                        moves.append(new)
        best = current
        for move in moves:
            scored = evaluator.score(current.with_(lookaheads={**lookaheads, **move}))
            if scored is not None and evaluator.better(scored, best):
                best = scored
        if best is current:
            return current
        current = best


# -- joint search -------------------------------------------------------------------------------


def tune(
    task_graph: TaskGraph,
    costs: CostModel | str,
    thread_map: ThreadMapSpec = None,
    *,
    frozen: Iterable[str] = FROZEN_TASKS,
    max_threads: int = 4,
    max_in_flight: int = 5,
    beam_width: int = 4,
    rounds: int = 6,
    max_children: int = 48,
    max_evaluations: int | None = 3000,
    time_limit_s: float | None = None,
    seed: int = 0,
    iterations: int = 12,
    streams: Iterable[str] = (),
    patience: int = 2,
) -> TuneResult:
    """Beam search over thread map x stream map x firing order, lookaheads by
    `auto_assign_lookaheads`, scored by the simulator; see the module docstring for the rules
    every candidate keeps.

    Each round expands every plan in the beam by one change: a thread-map preset (one thread,
    one per stream, one per task), one task moved to another (or a new) thread, one task moved
    to another stream, two adjacent independent tasks swapped in the firing order, or the firing
    order that puts the longest remaining work first. Children are scored with their current
    lookaheads (at most `max_children` per parent, drawn with `seed` when there are more). The
    best `2 * beam_width` of them, plus the best one of every thread partition not among those
    (a new thread often pays off only once lookaheads let it overlap), get their lookaheads
    from `auto_assign_lookaheads`; the best `beam_width` plans so far form the next beam. The
    search stops after `rounds` rounds, after `patience` rounds without a better plan, or when
    `max_evaluations` simulations (or `time_limit_s` seconds) are spent. The same inputs and
    seed give the same result, unless the time limit cut the search short (`stopped_early`).
    At equal predicted speed a plan with fewer batches in flight, fewer threads and fewer
    changes wins.

    Args:
        task_graph: the plan to tune; it must itself respect the constraints.
        costs: a `CostModel`, or a path to / the text of its JSON.
        thread_map: the plan's CPU threads, as `simulate` accepts them.
        frozen: tasks kept at lookahead 0 on the default stream.
        max_threads / max_in_flight: hard limits on every candidate.
        beam_width, rounds, max_children: the search's breadth and depth.
        max_evaluations / time_limit_s: budget (simulations / seconds); None: unbounded.
        seed: draws the children explored when a parent has more than `max_children`.
        iterations: batches per simulation.
        streams: streams the search may move tasks to besides the plan's declared ones (e.g.
            `("memcpy", "data_dist")` to let a one-stream plan overlap copies with compute).
    """
    costs = load_costs(costs)
    deadline = time.monotonic() + time_limit_s if time_limit_s is not None else None
    evaluator = _Evaluator(
        task_graph,
        costs,
        frozen=frozen,
        max_threads=max_threads,
        max_in_flight=max_in_flight,
        iterations=iterations,
        max_evaluations=max_evaluations,
        deadline=deadline,
        streams=streams,
    )
    rng = random.Random(seed)
    original = _candidate_of(task_graph, resolve_threads(task_graph, costs, thread_map))
    _require_legal(evaluator, original)
    original = evaluator.score(original)
    best = original
    stopped = False
    try:
        best = _beam_search(evaluator, original, costs, rng, rounds, patience, beam_width, max_children)
    except _BudgetExhausted:
        stopped = True
        best = evaluator.best_seen  # the best legal plan scored, the original at worst
    return _result(evaluator, original, best, stopped)


def _beam_search(
    evaluator: _Evaluator,
    original: _Candidate,
    costs: CostModel,
    rng: random.Random,
    rounds: int,
    patience: int,
    beam_width: int,
    max_children: int,
) -> _Candidate:
    """`tune`'s search from the scored `original`: its lookaheads climbed first, then up to
    `rounds` rounds of `_next_beam`, stopping after `patience` rounds without a better plan.
    Returns the best plan found (_BudgetExhausted when the evaluator's budget runs out)."""
    best = _climb_lookaheads(evaluator, original)
    beam = [best]
    stale = 0
    for _ in range(rounds):
        beam = _next_beam(evaluator, beam, costs, rng, beam_width, max_children)
        if beam and evaluator.better(beam[0], best):
            best, stale = beam[0], 0
        else:
            stale += 1
            if stale >= patience:
                break
    return best


def _next_beam(
    evaluator: _Evaluator,
    beam: list[_Candidate],
    costs: CostModel,
    rng: random.Random,
    beam_width: int,
    max_children: int,
) -> list[_Candidate]:
    """One round: every parent's children (at most `max_children` each, drawn with `rng`)
    scored with their lookaheads, the best of them refined (`_to_refine`, lookaheads climbed),
    and the best `beam_width` of the beam and those."""
    children: dict[tuple, _Candidate] = {}
    for parent in beam:
        options = _mutations(evaluator, parent, costs)
        if len(options) > max_children:
            options = [options[i] for i in sorted(rng.sample(range(len(options)), max_children))]
        for child in options:
            children.setdefault(child.key, child)
    scored = [s for c in children.values() if (s := evaluator.score(c)) is not None]
    scored.sort(key=evaluator.rank)
    refined = [_climb_lookaheads(evaluator, c) for c in _to_refine(scored, 2 * beam_width)]
    pool = {c.key: c for c in [*beam, *refined]}
    return sorted(pool.values(), key=evaluator.rank)[:beam_width]


def _to_refine(ranked: list[_Candidate], top: int) -> list[_Candidate]:
    """The `top` best, then the best of each thread partition not represented yet."""
    chosen = ranked[:top]
    partitions = {c.key[2] for c in chosen}
    for c in ranked[top:]:
        if c.key[2] not in partitions:
            partitions.add(c.key[2])
            chosen.append(c)
    return chosen


def _mutations(evaluator: _Evaluator, parent: _Candidate, costs: CostModel) -> list[_Candidate]:
    """Every one-step change of `parent` (lookaheads kept), in a fixed order."""
    out: list[_Candidate] = []
    names = sorted(evaluator.base)
    threads = dict(parent.threads)
    streams = dict(parent.streams)
    used = list(dict.fromkeys(threads[n] for n in names))
    presets: list[dict[str, str]] = [dict.fromkeys(names, "main")]
    if len(set(streams.values())) <= evaluator.max_threads:
        presets.append({n: streams[n] for n in names})
    if len(names) <= evaluator.max_threads:
        presets.append({n: n for n in names})
    out += [parent.with_(threads=p) for p in presets]
    fresh = next(f"t{k}" for k in range(len(names) + 1) if f"t{k}" not in used)
    for n in names:
        for thread in [*used, fresh]:
            if thread != threads[n]:
                out.append(parent.with_(threads={**threads, n: thread}))
    for n in names:
        if n in evaluator.frozen:
            continue
        for stream in evaluator.stream_slots:
            if stream != streams[n]:
                out.append(parent.with_(streams={**streams, n: stream}))
    graph = evaluator.graph(parent)
    if graph is not None:
        out += _order_mutations(evaluator, parent, graph, costs)
    return out


def _order_mutations(
    evaluator: _Evaluator, parent: _Candidate, graph: DependencyGraph, costs: CostModel
) -> list[_Candidate]:
    out = []
    direct = {(e.producer, e.consumer) for e in graph.edges}
    group_orders = [[t.name for t in order] for order in graph.group_orders]
    for s, order in enumerate(group_orders):
        for i in range(len(order) - 1):
            a, b = order[i], order[i + 1]
            if (a, b) in direct or (evaluator.base[a].nccl and evaluator.base[b].nccl):
                continue
            swapped = [list(o) for o in group_orders]
            swapped[s][i], swapped[s][i + 1] = b, a
            out.append(parent.with_(order=swapped))
    work = {n: costs[n].cpu_s + costs[n].device_s for n in evaluator.base}
    out.append(parent.with_(order=_longest_work_first(graph, group_orders, work)))
    return out


def _longest_work_first(graph: DependencyGraph, group_orders: list[list[str]], work: dict[str, float]) -> list:
    """Per group, a topological order that fires the task with the most work ahead of it first."""
    succ: dict[str, list[str]] = {}
    for e in graph.edges:
        succ.setdefault(e.producer, []).append(e.consumer)
    ahead: dict[str, float] = {}

    def remaining(n: str) -> float:
        if n not in ahead:
            ahead[n] = work[n] + max((remaining(m) for m in succ.get(n, ())), default=0.0)
        return ahead[n]

    out = []
    for order in group_orders:
        names = set(order)
        preds = {n: {e.producer for e in graph.edges if e.consumer == n and e.producer in names} for n in order}
        placed: list[str] = []
        while len(placed) < len(order):
            ready = [n for n in order if n not in placed and preds[n] <= set(placed)]
            placed.append(max(ready, key=lambda n: (remaining(n), -order.index(n))))
        out.append(placed)
    return out


def _result(evaluator: _Evaluator, original: _Candidate, best: _Candidate, stopped: bool) -> TuneResult:
    before = evaluator.graph(original)
    after = evaluator.graph(best)
    position_before = {t.name: i for i, t in enumerate(before.order)}
    t0 = dict(original.threads)
    t1 = _readable_threads(t0, dict(best.threads), after)
    s0, s1 = dict(original.streams), dict(best.streams)
    l0, l1 = dict(original.lookaheads), dict(best.lookaheads)
    changes = tuple(
        TaskChange(
            t.name,
            thread=(t0[t.name], t1[t.name]),
            stream=(s0[t.name], s1[t.name]),
            lookahead=(l0[t.name], l1[t.name]),
            position=(position_before[t.name], i),
        )
        for i, t in enumerate(after.order)
    )
    used = {t.stream for t in after.order}
    declared = tuple(s for s in evaluator.stream_slots if s in evaluator.declared_streams or s in used)
    return TuneResult(
        task_graph=TaskGraph(after.task_graph.groups, declared),
        thread_map=t1,
        original_s=original.score,
        best_s=best.score,
        changes=changes,
        evaluations=evaluator.evaluations,
        stopped_early=stopped,
    )


def _readable_threads(before: dict[str, str], after: dict[str, str], graph: DependencyGraph) -> dict[str, str]:
    """The tuned thread partition, each thread named after the input thread most of its tasks
    came from (ties: the earliest task's), where that name is still free (else t0, t1, ...)."""
    order = [t.name for t in graph.order]
    groups: dict[str, list[str]] = {}
    for n in order:
        groups.setdefault(after[n], []).append(n)
    names: dict[str, str] = {}
    taken: set[str] = set()
    for group, members in groups.items():
        origins = [before[n] for n in members]
        wish = max(dict.fromkeys(origins), key=origins.count)
        if wish in taken:
            reserved = taken | set(before.values())
            wish = next(f"t{k}" for k in range(len(after) + len(reserved) + 1) if f"t{k}" not in reserved)
        names[group] = wish
        taken.add(wish)
    return {n: names[after[n]] for n in after}
