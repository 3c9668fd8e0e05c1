"""Text picture of a compiled plan: what `recsys-plan` prints.

Why: a plan is only trustworthy if the user can see what the engine will do with it -- the
order tasks run in, which thread submits each, what waits on what, how many batches are in
flight and which batch each task touches in each internal iteration.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from recsys_pipe.config.compile import CompiledPlan
from recsys_pipe.config.schema import ThreadMapConfig
from recsys_pipe.engine import fires

__all__ = ["FiringRow", "FiringTable", "firing_table", "render_plan", "describe_thread_map"]


@dataclass(frozen=True)
class FiringRow:
    """Tasks sharing a lookahead and a stream; `cells[i]` is the batch they process at
    internal iteration i (None: they do not fire)."""

    lookahead: int
    stream: str
    tasks: tuple[str, ...]
    cells: tuple[int | None, ...]


@dataclass(frozen=True)
class FiringTable:
    """Which batch every task processes, iteration by iteration, for `num_batches` batches."""

    num_batches: int
    max_lookahead: int
    phases: tuple[str, ...]  # per iteration: prefill | steady | drain
    rows: tuple[FiringRow, ...]
    returns: tuple[int | None, ...]  # batch whose step_result progress() returns after iteration i

    @property
    def num_iterations(self) -> int:
        return len(self.phases)


def firing_table(plan: CompiledPlan, num_batches: int = 4) -> FiringTable:
    """The firing mask (`L - k <= i < M + L - k`, batch `i - L + k`) per row.

    Args:
        plan: the compiled plan.
        num_batches: M, how many batches to play through (prefill, steady state and drain).

    Returns:
        One row per lookahead and stream: the batch it processes in each internal iteration."""
    L, M = plan.graph.max_lookahead, num_batches
    iterations = range(M + L)
    phases = tuple("prefill" if i < L and i < M else "drain" if i >= M else "steady" for i in iterations)
    groups: dict[tuple[int, str], list[str]] = {}
    stream_rank = {s: r for r, s in enumerate(plan.task_graph.stream_slots)}
    for t in plan.order:
        groups.setdefault((t.lookahead, t.stream), []).append(t.name)
    rows = []
    for (k, stream), names in sorted(groups.items(), key=lambda kv: (-kv[0][0], stream_rank.get(kv[0][1], 99))):
        cells = tuple(i - L + k if fires(k, L, i, M) else None for i in iterations)
        rows.append(FiringRow(k, stream, tuple(names), cells))
    returns = tuple(i - L if fires(0, L, i, M) else None for i in iterations)
    return FiringTable(M, L, phases, tuple(rows), returns)


def describe_thread_map(tm: ThreadMapConfig) -> str:
    """One line: the map's name and what it does."""
    if tm.strategy == "dict":
        groups: dict[str, list[str]] = {}
        for task, thread in tm.map.items():
            groups.setdefault(thread, []).append(task)
        parts = [f"{thread} = {{{', '.join(tasks)}}}" for thread, tasks in groups.items()]
        what = f"{'; '.join(parts)}; everything else on '{tm.default}'"
    elif tm.strategy == "single":
        what = f"every task on thread '{tm.thread}'"
    elif tm.strategy == "per_task":
        what = "one thread per task"
    else:
        what = "one thread per stream"
    name = tm.name or tm.strategy
    return f"{name} ({what})"


def _table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[c]) for r in rows)) if rows else len(h) for c, h in enumerate(headers)]
    fmt = lambda cells: indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return [fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def render_plan(plan: CompiledPlan, num_batches: int = 4) -> str:
    """The multi-line text shown by `recsys-plan`.

    Args:
        plan: the compiled plan.
        num_batches: how many batches the firing table at the end plays through.

    Returns:
        The order, streams, threads, NCCL tickets, CPU edges, event waits and firing table."""
    sections = (
        _header(plan),
        _tasks(plan),
        _cpu_edges(plan),
        _event_waits(plan),
        _cross_iteration(plan),
        _timing(plan, num_batches),
    )
    return "\n".join(line for section in sections for line in section)


def _header(plan: CompiledPlan) -> list[str]:
    """The plan's name, executor, streams, thread map and in-flight batches."""
    cfg, graph = plan.config, plan.graph
    title = f"plan: {cfg.name or '(unnamed)'}"
    if cfg.description:
        title += f" -- {cfg.description}"
    out = [title, f"executor: {cfg.executor}    streams: {', '.join(plan.task_graph.stream_slots)}"]
    if plan.threaded:
        threads = list(dict.fromkeys(plan.thread_of[t.name] for t in plan.order))
        out.append(
            f"thread map: {describe_thread_map(cfg.thread_map)} -> {len(threads)} thread(s): {', '.join(threads)}"
        )
    else:
        out.append("thread map: not used (sequential executor: every task on the calling thread)")
    out.append(f"max lookahead: {graph.max_lookahead} -> in-flight batches: {graph.in_flight_batches}")
    return out


def _tasks(plan: CompiledPlan) -> list[str]:
    """The tasks in topological order with their lookahead, stream, thread, NCCL ticket and
    function, and the options the plan sets."""
    cfg = plan.config
    out = ["", "tasks, in topological order (the order each iteration submits them):"]
    rows = []
    ticket = 0
    fns = plan.fn_paths()  # a registered task shows its function's import path
    for n, t in enumerate(plan.order):
        nccl = "-"
        if t.nccl:
            nccl, ticket = f"#{ticket}", ticket + 1
        rows.append([str(n), t.name, str(t.lookahead), t.stream, plan.thread_of[t.name], nccl, fns[t.name]])
    out += _table(["#", "task", "lookahead", "stream", "thread", "nccl", "fn"], rows)
    out.append("  (nccl #n: ticket of the ordered NCCL lock -- collectives are issued in this order on every rank)")
    options = {t.name: cfg.tasks[t.name].options for t in plan.order if cfg.tasks[t.name].options}
    if options:
        out += ["", "task options (as the plan sets them; the rest are the task's defaults):"]
        out += [
            f"  {name}: {', '.join(f'{key}={json.dumps(value)}' for key, value in sorted(opts.items()))}"
            for name, opts in options.items()
        ]
    return out


def _cpu_edges(plan: CompiledPlan) -> list[str]:
    """The CPU edges of an iteration, by consumer, and what enforces each."""
    out = ["", "CPU dependency edges (same iteration: producer finishes before consumer starts):"]
    position = {t.name: n for n, t in enumerate(plan.order)}
    edges = sorted(plan.cpu_edges(), key=lambda e: (position[e.consumer], position[e.producer]))
    if not edges:
        return [*out, "  (none)"]
    erows = []
    for e in edges:
        note = "cross-thread wait" if plan.threaded and e.cross_thread else "same thread: program order"
        if not plan.threaded:
            note = "program order"
        erows.append([e.producer, "->", e.consumer, e.kind, note])
    out += _table(["producer", "", "consumer", "kind", "enforced by"], erows)
    out.append("  (stream_fifo: previous task on the same stream; kept across threads to preserve stream order)")
    return out


def _event_waits(plan: CompiledPlan) -> list[str]:
    """The cross-stream event waits: which consumer waits on which producer's event, at which offset."""
    out = [
        "",
        "event waits (cross-stream; consumer's stream waits on the producer's event found at",
        "ring slot offset k = the batch k iterations ahead of the one being trained):",
    ]
    wrows = []
    for t in plan.order:
        for w in plan.graph.event_waits.get(t.name, ()):
            wrows.append([t.name, t.stream, "waits", w.producer, w.producer_stream, str(w.slot_offset)])
    if wrows:
        return out + _table(["consumer", "stream", "", "producer", "stream", "slot_offset"], wrows)
    return [*out, "  (none: every dependency is on the same stream, ordered by stream FIFO)"]


def _cross_iteration(plan: CompiledPlan) -> list[str]:
    """The dependencies on earlier iterations (Δ >= 1), which the ring's rotation satisfies."""
    cross: dict[tuple[str, str, int], list[str]] = {}
    for d in plan.graph.dependencies:
        if not d.in_iteration:
            cross.setdefault((d.producer, d.consumer, d.delta), []).append(f"{d.field}[{d.index}]")
    if not cross:
        return []
    return [
        "",
        "cross-iteration dependencies (satisfied by ring rotation, no in-iteration edge):",
        *_table(
            ["producer", "", "consumer", "declared in", "iterations earlier (Δ)"],
            [[p, "->", c, ", ".join(fields), str(delta)] for (p, c, delta), fields in cross.items()],
        ),
    ]


def _timing(plan: CompiledPlan, num_batches: int) -> list[str]:
    """The firing table: which batch each (lookahead, stream) row processes per internal iteration."""
    graph = plan.graph
    table = firing_table(plan, num_batches)
    out = [
        "",
        f"timing: batch processed per internal iteration i ({num_batches} batches; prefill "
        f"i < {graph.max_lookahead}, drain i >= {num_batches}):",
    ]
    headers = ["row", *(f"i={i}" for i in range(table.num_iterations))]
    trows = [["phase", *table.phases]]
    for r in table.rows:
        trows.append([f"la{r.lookahead} {r.stream}", *(f"b{c}" if c is not None else "." for c in r.cells)])
    trows.append(["progress() returns", *(f"b{c}" if c is not None else "-" for c in table.returns)])
    out += _table(headers, trows)
    out += [f"  la{r.lookahead} {r.stream}: {', '.join(r.tasks)}" for r in table.rows]
    return out
