"""Predict how a plan runs: a discrete-event playback of its prefill, steady state and drain.

The playback follows the engine's own semantics, computed by the engine's own functions:

- which tasks run in internal iteration `i` (`fires`), on which batch (`i - L + lookahead`);
- each group's tasks in topological order (`compile_dependencies(...).group_orders`);
- CPU threads: each thread submits its tasks one after another in that order; a task waits for
  the cross-thread CPU edges the threaded executor enforces (`cpu_edges`); every executor call
  (one per group and iteration) ends with a barrier over all its threads, and the next starts
  after it;
- NCCL tickets: `nccl=True` tasks take tickets in topological order; a ticket holder starts only
  after the previous holder finished on the CPU, whatever thread either is on;
- streams: a task's device work starts no earlier than its CPU span starts (kernels are launched
  during the host span), after the previous work on its stream (FIFO in submission order), and
  after the producer instance of every cross-stream event wait (the instance the ring holds at
  the wait's `slot_offset`: the producer's run `producer.lookahead - slot_offset` iterations
  earlier; when that run does not exist, e.g. in the prefill, the engine falls back to
  `wait_stream`, modelled as waiting for all work submitted to the producer's stream so far);
- NCCL tasks' device work also holds the one communicator (serialised in ticket order across
  streams); tasks marked `pcie` in the cost model also hold the one PCIe link (first come,
  first served); a task marked `host_sync` keeps its thread until its device work finished.

Each task instance has a host span (`cpu_s` on its thread) and a device span (`device_s` on its
stream). Each internal iteration starts with the cost model's time outside tasks (pulling the
batch, rotating the ring: on the calling thread, in series with the whole iteration), a span
named `(outside tasks)` that holds no resource. Resource names in the result: `thread:<id>`,
`stream:<name>`, `nccl`, `pcie`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from recsys_pipe.autosched.costs import CostModel, Statistic, TaskCost
from recsys_pipe.autosched.events import EventEngine, Timeline
from recsys_pipe.engine import Task, TaskGraph, compile_dependencies, cpu_edges, fires, resolve_thread_map

__all__ = ["CriticalStep", "SimResult", "SimSpan", "load_costs", "resolve_threads", "simulate"]

#: Thread id used when every task runs on one thread (the sequential executor's caller thread).
MAIN_THREAD = "main"

ThreadMapSpec = None | str | Mapping[str, str] | Callable[[Task], str]


@dataclass(frozen=True)
class SimSpan:
    """One task instance's occupation of one resource."""

    task: str
    batch: int
    iteration: int
    resource: str
    start: float
    end: float


@dataclass(frozen=True)
class CriticalStep:
    """One link of the critical path: this span started when `reason` allowed it.

    `reason` names the constraint that bound the start, e.g. `order on thread:io`,
    `cpu edge (slot) from h2d`, `barrier`, `nccl ticket`, `order on stream:default`,
    `event wait on h2d`, `submission` (device work waits for its host span to start),
    `host sync`, `busy pcie`, or `start` for the first step.
    """

    task: str
    batch: int | None
    iteration: int
    resource: str
    start: float
    end: float
    reason: str


@dataclass(frozen=True)
class SimResult:
    """What `simulate` predicts.

    Attributes:
        iteration_s: steady-state time per training step: the long-run mean interval between
            successive batch completions. A batch *completes* when its last task instance
            ends, host or device, over all lookaheads (normally the lookahead-0 task that
            writes `step_result`; work nobody waits for counts too, so a stream falling further
            behind every step shows as a longer step, as it would in a long run). It is
            measured once the playback has *settled*: over the last steady-state iterations
            (those where every lookahead fires) every task instance starts a fixed time after
            its counterpart one iteration (or `period` iterations) earlier, and nothing it
            waits for advances faster, so every later iteration repeats the pattern. The step
            time is then the largest of those per-iteration advances (divided by `period`).
            Independent parts may advance at different rates (a host running ahead of a
            device-bound plan): the slowest sets the pace. Until the playback settles (the
            start-up transient can outlast the requested batches, e.g. when the prefill queues
            device work that the steady state drains slowly), `simulate` plays twice as many
            batches, up to 8x. If it never settles (parts advancing at different rates that
            contend for a first-come link jitter forever), `period` is 0 and `iteration_s` is the
            largest mean advance per iteration of any task instance over the second half of
            the steady-state iterations.
        completions: completion time of every batch, by batch index.
        window: the first and last batch of the second half of the steady-state batches
            (those completed in steady-state iterations, `0 .. M-L-1`).
        busy_per_iteration: busy time of each resource in one steady-state iteration (every
            steady-state iteration runs the same task instances; no plan steps faster than
            the largest of these).
        utilisation: `busy_per_iteration / iteration_s`, the busy fraction of each resource
            per steady-state step. (Measuring a time window instead would report idle host
            threads whenever the host has run ahead of a device-bound plan.)
        critical_path: the chain of task instances that sets the step time: from the end of
            the last steady-state batch's latest task instance among the slowest-advancing
            ones, walked back through the constraint that bound each start until one step
            started more than one step time earlier.
        spans: every task instance on every resource it used.
        thread_of: task -> thread id used.
        num_batches: batches played (M); max_lookahead: L.
        period: the steady-state pattern repeats every `period` iterations (usually 1); 0 when
            the playback never settled.
    """

    iteration_s: float
    completions: tuple[float, ...]
    window: tuple[int, int]
    utilisation: dict[str, float]
    busy_per_iteration: dict[str, float]
    critical_path: tuple[CriticalStep, ...]
    spans: tuple[SimSpan, ...] = field(repr=False)
    thread_of: dict[str, str] = field(repr=False)
    num_batches: int = 0
    max_lookahead: int = 0
    period: int = 1

    @property
    def settled(self) -> bool:
        """Whether the playback reached a repeating steady state (`period` > 0)."""
        return self.period > 0

    @property
    def rows(self) -> list[str]:
        """Resources in display order: threads, streams, then the communicator and the PCIe link."""
        names = list(dict.fromkeys(s.resource for s in self.spans))
        order = {"thread": 0, "stream": 1, "nccl": 2, "pcie": 3}
        return sorted(names, key=lambda r: (order.get(r.split(":")[0], 4), names.index(r)))

    def report(self) -> str:
        """The prediction as text: step time, utilisation per resource, the critical path."""
        lines = [f"predicted step: {self.iteration_s * 1e3:.4g} ms ({self.num_batches} batches played)"]
        if not self.settled:
            lines[0] += "; did not settle into a repeating pattern: mean over the last iterations"
        lines.append("utilisation per step (busy time):")
        for r in self.rows:
            lines.append(f"  {r:<24} {self.utilisation[r]:6.1%}  ({self.busy_per_iteration[r] * 1e3:.4g} ms)")
        lines.append("critical path (each step started when the reason allowed it):")
        for c in self.critical_path:
            batch = "" if c.batch is None else f" batch {c.batch}"
            lines.append(
                f"  {c.start * 1e3:10.4f} .. {c.end * 1e3:10.4f} ms  {c.task}{batch} on {c.resource}: {c.reason}"
            )
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike, iterations: int = 3, title: str | None = None) -> Path:
        """Gantt chart of the last `iterations` steady-state iterations (critical path outlined)."""
        from recsys_pipe.autosched.gantt import Bar, draw_gantt

        end = self.completions[self.window[1]]
        lo = max(0.0, end - (iterations + 0.5) * self.iteration_s)
        critical = {(c.task, c.iteration, c.resource) for c in self.critical_path}
        bars = [
            Bar(s.resource, s.start, s.end, s.task, s.batch, (s.task, s.iteration, s.resource) in critical)
            for s in self.spans
        ]
        if title is None:
            title = f"predicted step {self.iteration_s * 1e3:.3f} ms (critical path outlined)"
        return draw_gantt(bars, self.rows, path, title=title, time_range=(lo, end + 0.05 * self.iteration_s))


def load_costs(costs: CostModel | str | os.PathLike) -> CostModel:
    """A CostModel as given, or loaded from a JSON path or JSON text."""
    return costs if isinstance(costs, CostModel) else CostModel.from_json(costs)


def resolve_threads(task_graph: TaskGraph, costs: CostModel, thread_map: ThreadMapSpec = None) -> dict[str, str]:
    """task name -> thread id, for any thread-map form the simulator accepts.

    None: each task's `thread` recorded in the cost model when every task has one, else one
    thread for all (the sequential executor). "sequential" / "single": one thread. Otherwise
    what the threaded executor accepts: "by_stream", "per_task", a dict `{task: thread}` with an
    optional "default" entry, or a callable `Task -> thread id`.
    """
    tasks = task_graph.tasks
    if thread_map is None:
        recorded = {t.name: costs[t.name].thread for t in tasks}
        if all(recorded.values()):
            return {name: str(thread) for name, thread in recorded.items()}
        return {t.name: MAIN_THREAD for t in tasks}
    if thread_map in ("sequential", "single"):
        return {t.name: MAIN_THREAD for t in tasks}
    thread_of = resolve_thread_map(thread_map)
    return {t.name: str(thread_of(t)) for t in tasks}


def simulate(
    task_graph: TaskGraph,
    costs: CostModel | str | os.PathLike,
    thread_map: ThreadMapSpec = None,
    iterations: int = 12,
    statistic: Statistic = "median",
) -> SimResult:
    """Play `task_graph` over `iterations` batches (M) against `costs`; see `SimResult`.

    The playback runs M + L internal iterations (L = max lookahead): L prefill, M - L steady,
    L drain; M must be at least L + 3 so that the steady state has a second half to measure.

    Args:
        task_graph: the plan, as an engine `TaskGraph` (validated here by `compile_dependencies`).
        costs: a `CostModel`, or a path to / the text of its JSON; must cover every task.
        thread_map: see `resolve_threads`.
        iterations: the number of batches M (more are played if the steady state takes longer
            to settle; see `SimResult.iteration_s`).
        statistic: "median" plays the median costs (a typical step), "mean" the means where the
            cost model has them (the long-run step that samples/s follows).
    """
    if statistic not in ("median", "mean"):
        raise ValueError(f"statistic must be 'median' or 'mean', got {statistic!r}")
    costs = load_costs(costs)
    graph = compile_dependencies(task_graph)
    missing = [t.name for t in graph.order if t.name not in costs]
    if missing:
        raise KeyError(f"cost model has no entry for task(s) {', '.join(missing)}")
    thread_of = resolve_threads(task_graph, costs, thread_map)
    L = task_graph.max_lookahead
    M = iterations
    if M < L + 3:
        raise ValueError(
            f"iterations={M} is too few for max lookahead {L}: need at least {L + 3} (L prefill + 3 steady)"
        )
    longest = _MAX_GROWTH * iterations
    while True:
        playback = _Playback(graph, costs, thread_of, M, statistic)
        timeline = playback.run()
        settled = _settle(playback, timeline)
        if settled is not None or longest <= M:
            break
        M *= 2  # still settling: the start-up transient outlasted the playback; play longer
    return _summarise(playback, timeline, settled, thread_of)


#: Name of the per-iteration span of the time outside tasks (on the critical path when it binds).
OUTSIDE_TASKS = "(outside tasks)"
#: span kinds that are not task instances (no batch, not in the spans or completions)
_NOT_TASKS = ("barrier", "outside")

#: `simulate` plays at most this many times the requested batches while waiting for it to settle.
_MAX_GROWTH = 8
#: longest repeating pattern (in iterations) recognised as a steady state
_MAX_PERIOD = 4


# -- playback -----------------------------------------------------------------------------------


class _Playback:
    """Builds the spans of every task instance and their constraints, then runs the engine."""

    def __init__(self, graph, costs: CostModel, thread_of: dict[str, str], num_batches: int, statistic: Statistic):
        self.graph = graph
        self.costs: dict[str, TaskCost] = {t.name: costs[t.name] for t in graph.order}
        self.statistic = statistic
        self.outside_s = costs.outside(statistic)
        self.thread_of = thread_of
        self.M = num_batches
        self.L = graph.max_lookahead
        self.tasks = {t.name: t for t in graph.order}
        self.engine = EventEngine()
        # span id -> (task, batch, iteration, kind); kind in host/device/sync/barrier
        self.info: list[tuple[str, int | None, int, str]] = []
        self.device: dict[tuple[str, int], int] = {}
        self.submits: dict[int, tuple[str, int]] = {}  # host span -> (stream, device span)
        self.fallback: dict[int, list[tuple[int, str]]] = {}  # host span -> [(device span, stream)]
        self._edges_cache: dict[tuple[str, ...], dict[str, list[tuple[str, str]]]] = {}
        self.last_submitted: dict[str, int] = {}  # stream -> device span submitted there last
        self.by_iteration: list[list[int]] = [[] for _ in range(num_batches + self.L)]  # span ids in creation order

    def _add(self, key: tuple[str, int | None, int, str], duration: float, resources: list[str]) -> int:
        i = self.engine.add(key, duration, resources)
        self.info.append(key)
        self.by_iteration[key[2]].append(i)
        return i

    def _cross_thread_preds(self, active: tuple[Task, ...]) -> dict[str, list[tuple[str, str]]]:
        names = tuple(t.name for t in active)
        preds = self._edges_cache.get(names)
        if preds is None:
            preds = {}
            for e in cpu_edges(self.graph, active):
                if self.thread_of[e.producer] != self.thread_of[e.consumer]:
                    preds.setdefault(e.consumer, []).append((e.producer, e.kind))
            self._edges_cache[names] = preds
        return preds

    def run(self) -> Timeline:
        engine = self.engine
        threads = {f"thread:{th}" for th in self.thread_of.values()}
        for r in sorted(threads | {f"stream:{t.stream}" for t in self.tasks.values()}):
            engine.resource(r)
        engine.resource("nccl")
        engine.resource("pcie", "first_come")
        L, M = self.L, self.M
        barrier: int | None = None
        for i in range(M + L):
            if self.outside_s:  # the batch pull and ring rotation, in series with the iteration
                outside = self._add((OUTSIDE_TASKS, None, i, "outside"), self.outside_s, [])
                if barrier is not None:
                    engine.after(outside, barrier, reason="barrier")
                barrier = outside
            for group_order in self.graph.group_orders:
                active = tuple(t for t in group_order if fires(t.lookahead, L, i, M))
                if active:
                    barrier = self._stage(i, active, barrier)
        return engine.run(self._on_start)

    def _stage(self, i: int, active: tuple[Task, ...], barrier: int | None) -> int:
        engine = self.engine
        preds = self._cross_thread_preds(active)
        done: dict[str, int] = {}  # task -> span whose end means "finished on the CPU"
        last_on_thread: dict[str, int] = {}
        ticket: int | None = None
        for t in active:
            cost = self.costs[t.name]
            thread = self.thread_of[t.name]
            batch = i - self.L + t.lookahead
            host = self._add((t.name, batch, i, "host"), cost.host(self.statistic), [f"thread:{thread}"])
            if barrier is not None and thread not in last_on_thread:
                engine.after(host, barrier, reason="barrier")
            for producer, kind in preds.get(t.name, ()):
                engine.after(host, done[producer], reason=f"cpu edge ({kind}) from {producer}")
            if t.nccl and ticket is not None:
                engine.after(host, ticket, reason="nccl ticket")
            res = [f"stream:{t.stream}"]
            if t.nccl:
                res.append("nccl")
            if cost.pcie:
                res.append("pcie")
            device = self._add((t.name, batch, i, "device"), cost.device(self.statistic), res)
            engine.after(device, host, at="start", reason="submission")
            self.device[(t.name, i)] = device
            self.submits[host] = (t.stream, device)
            for wait in self.graph.event_waits[t.name]:
                producer = self.tasks[wait.producer]
                j = i - (producer.lookahead - wait.slot_offset)  # the iteration that recorded the event
                source = self.device.get((wait.producer, j)) if j >= 0 else None
                if source is not None:
                    engine.after(device, source, reason=f"event wait on {wait.producer}")
                else:  # no event in the ring (prefill/drain): the engine waits for the whole stream
                    self.fallback.setdefault(host, []).append((device, wait.producer_stream))
            finished = host
            if cost.host_sync:
                finished = self._add((t.name, batch, i, "sync"), 0.0, [f"thread:{thread}"])
                engine.after(finished, device, reason="host sync")
            if t.nccl:
                ticket = finished
            done[t.name] = finished
            last_on_thread[thread] = finished
        end = self._add(("(barrier)", None, i, "barrier"), 0.0, [])
        for span in last_on_thread.values():
            engine.after(end, span, reason="barrier")
        return end

    def _on_start(self, span: int, time: float) -> None:
        submit = self.submits.get(span)
        if submit is None:
            return
        last = self.last_submitted
        for device, stream in self.fallback.get(span, ()):
            previous = last.get(stream)
            if previous is not None:
                self.engine.after(device, previous, reason=f"wait_stream {stream} (no event recorded yet)")
        stream, device = submit
        last[stream] = device


# -- steady state ------------------------------------------------------------------------------


def _settle(playback: _Playback, timeline: Timeline) -> tuple[float, int, list[float]] | None:
    """(step time, period, per-instance advance) once the playback has settled, else None.

    Settled with period p means: in the second half of the steady-state iterations, each task
    instance starts exactly `advance[j]` after its counterpart p iterations earlier, and every
    constraint on the starts of the last p iterations comes from that window and advances by
    no more than the instance it bounds. Then the binding bound of each start advances at
    that instance's own rate and no other bound can overtake it, so (the playback being
    time-invariant in the steady state) every later iteration repeats the pattern. A shared
    first-come link is the one approximation: a previous holder that advances faster only
    counts if it actually delayed the start (parts at different rates that share a link
    without waiting for it are taken as settled).
    """
    L, M = playback.L, playback.M
    first, last = L + (M - L) // 2, M - 1
    rows = playback.by_iteration
    if first >= last or len({len(rows[i]) for i in range(first, last + 1)}) != 1:
        return None
    start = timeline.start
    where = {k: j for i in range(first, last + 1) for j, k in enumerate(rows[i])}
    scale = max(abs(start[k]) for k in rows[last]) + max(timeline.end[k] - start[k] for k in rows[last])
    tol = 1e-12 * max(scale, 1e-300) * M
    for p in range(1, _MAX_PERIOD + 1):
        if last - p < first:
            break
        advance = [start[a] - start[b] for a, b in zip(rows[last], rows[last - p])]
        steady = all(
            abs(start[a] - start[b] - adv) <= tol
            for i in range(first + p, last + 1)
            for a, b, adv in zip(rows[i], rows[i - p], advance)
        )
        if not steady:
            continue
        latest = [(j, k) for i in range(last - p + 1, last + 1) for j, k in enumerate(rows[i])]
        bounded = all(
            pred in where and advance[where[pred]] <= advance[j] + tol
            for j, k in latest
            for pred, _, _ in timeline.terms[k]
        ) and all(  # a shared link: whoever held it must not hold this one back ever more
            not _delayed_by_link(timeline, k) or (pred in where and advance[where[pred]] <= advance[j] + tol)
            for j, k in latest
            for pred in timeline.followed[k]
        )
        if bounded:
            task_instances = [a for j, a in enumerate(advance) if playback.info[rows[last][j]][3] not in _NOT_TASKS]
            return max(task_instances) / p, p, advance
    return None


def _delayed_by_link(timeline: Timeline, span: int) -> bool:
    bound = timeline.bound[span]
    return bound is not None and bound.reason.startswith("busy ")


# -- summary ------------------------------------------------------------------------------------


def _summarise(
    playback: _Playback,
    timeline: Timeline,
    settled: tuple[float, int, list[float]] | None,
    thread_of: dict[str, str],
) -> SimResult:
    info, L, M = playback.info, playback.L, playback.M
    completions = [0.0] * M
    spans = []
    for k, (task, batch, iteration, kind) in enumerate(info):
        if kind in _NOT_TASKS:
            continue
        completions[batch] = max(completions[batch], timeline.end[k])
        if kind != "sync":
            spans.extend(
                SimSpan(task, batch, iteration, resource, timeline.start[k], timeline.end[k])
                for resource in timeline.resources[k]
            )
    steady = M - L  # batches 0 .. steady-1 complete in steady-state iterations
    first, last = steady // 2, steady - 1
    of_last = [k for k, key in enumerate(info) if key[1] == last and key[3] not in _NOT_TASKS]
    if settled is not None:
        iteration_s, period, advance = settled
        slot = {k: j for i in range(L, M) for j, k in enumerate(playback.by_iteration[i])}
        pace = max(advance[slot[k]] for k in of_last if k in slot)
        of_last = [k for k in of_last if k in slot and advance[slot[k]] >= pace * (1 - 1e-9)]
    else:  # the fastest mean advance of any task instance over the second half of the steady state
        begin = L + (M - L) // 2
        span_count = M - 1 - begin
        iteration_s = max(
            (timeline.start[a] - timeline.start[b]) / span_count
            for a, b in zip(playback.by_iteration[M - 1], playback.by_iteration[begin])
            if info[a][3] not in _NOT_TASKS
        )
        period = 0
    source = max(of_last, key=lambda k: (timeline.end[k], k))

    busy: dict[str, float] = {}
    probe = M - 1  # every steady-state iteration runs the same task instances
    for sp in spans:
        busy[sp.resource] = busy.get(sp.resource, 0.0) + ((sp.end - sp.start) if sp.iteration == probe else 0.0)
    utilisation = {r: (b / iteration_s if iteration_s > 0 else 0.0) for r, b in busy.items()}

    return SimResult(
        iteration_s=iteration_s,
        completions=tuple(completions),
        window=(first, last),
        utilisation=utilisation,
        busy_per_iteration=busy,
        critical_path=_critical_path(
            info, timeline, source, timeline.end[source] - iteration_s, 4 * len(playback.by_iteration[M - 1])
        ),
        spans=tuple(spans),
        thread_of=dict(thread_of),
        num_batches=M,
        max_lookahead=L,
        period=period,
    )


def _critical_path(info, timeline: Timeline, end: int, since: float, longest: int) -> tuple[CriticalStep, ...]:
    chain = [end]
    eps = 1e-12 * max(1.0, abs(since))
    while timeline.start[chain[-1]] >= since - eps and timeline.bound[chain[-1]] is not None and len(chain) < longest:
        chain.append(timeline.bound[chain[-1]].span)
    steps = []
    for k in reversed(chain):
        task, batch, iteration, _ = info[k]
        bound = timeline.bound[k]
        resources = timeline.resources[k]
        steps.append(
            CriticalStep(
                task=task,
                batch=batch,
                iteration=iteration,
                resource=resources[0] if resources else "-",
                start=timeline.start[k],
                end=timeline.end[k],
                reason=bound.reason if bound is not None else "start",
            )
        )
    return tuple(steps)
