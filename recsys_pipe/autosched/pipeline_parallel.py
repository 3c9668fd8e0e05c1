"""Pipeline-parallel schedules: build, check and time them with the plan simulator's event engine.

The schedules themselves are data of the leaf package `recsys_pipe.pp_schedules` (re-exported
here): `build(name, p, m)` makes 1F1B, ZB-H1, ZB-H2 or DualPipe; `from_csv` reads a schedule
written by `torch.distributed.pipelining` (and `to_csv` writes one), so a torch schedule can be
timed with measured durations; `validate` checks a schedule. `simulate` plays one and reports
its makespan and bubble.

What waits for what is `recsys_pipe.pp_schedules.schedule_graph`. Each rank runs its actions in
list order, one at a time; a transfer between ranks takes `t_comm` on the directed link between
them (first come, first served).
Sending can also cost the sending rank time (`t_send`: posting the message, or writing it out
when its receive is posted): each `SEND_*` action takes it, or, without those, each compute
whose activation or gradient goes to another rank takes it on top of its own duration.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recsys_pipe.autosched.events import EventEngine, Timeline
from recsys_pipe.pp_schedules import (
    SCHEDULES,
    Action,
    PipelineSchedule,
    PipelineScheduleError,
    build,
    from_csv,
    schedule_graph,
    to_csv,
    validate,
)
from recsys_pipe.pp_schedules.spans import PipelineSpan, peak_activations

__all__ = [
    "SCHEDULES",
    "Action",
    "PipelineResult",
    "PipelineSchedule",
    "PipelineScheduleError",
    "PipelineSpan",
    "build",
    "from_csv",
    "measured_result",
    "peak_activations",
    "simulate",
    "simulate_measured",
    "to_csv",
    "validate",
]

Schedule = PipelineSchedule | Mapping | Sequence


@dataclass(frozen=True)
class PipelineResult:
    """What `simulate` predicts for one pipeline iteration.

    Attributes:
        makespan: first start to last end, over all ranks.
        bubble: the idle time of the rank that idles most within the makespan:
            `makespan - min(busy)`. For schedules where every rank does the same work (1F1B,
            ZB-H1, ZB-H2) that is `makespan - m * (T_F + T_B + T_W)`; DualPipe's middle ranks
            overlap the most F&B pairs, so they do the least work and idle most.
        bubble_without_sync: the largest idle time inside one rank's own window (its first
            start to its last end): what an iteration costs beyond the work when each rank
            starts the next iteration as soon as it finished this one (no optimizer
            synchronisation across ranks, as ZB-H2's post-validation allows).
        busy: per rank, the sum of its actions' durations.
        peak_activations: per rank, the most microbatches whose forward ran and whose
            backward (B or BW) has not (activations held), counted along the action order.
        spans: every action on the timeline.
    """

    makespan: float
    bubble: float
    bubble_without_sync: float
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]
    spans: tuple[PipelineSpan, ...] = field(repr=False)
    name: str = ""

    def plot(self, path: str | os.PathLike, title: str | None = None) -> Path:
        """Gantt chart: one row per rank, actions coloured by microbatch."""
        from recsys_pipe.autosched.gantt import Bar, draw_gantt

        rows = [f"rank {r}" for r in range(len(self.busy))]
        bars = [
            Bar(f"rank {s.rank}", s.start, s.end, s.label, s.microbatch if s.microbatch is not None else -1)
            for s in self.spans
        ]
        if title is None:
            title = f"{self.name or 'pipeline'}: makespan {self.makespan:g}, bubble {self.bubble:g}"
        return draw_gantt(bars, rows, path, title=title, legend_title="microbatch", time_unit=("", 1.0))


def simulate(
    actions: Schedule,
    t_f: float,
    t_b: float,
    t_w: float,
    t_comm: float = 0.0,
    *,
    t_fb: float | None = None,
    t_send: float = 0.0,
) -> PipelineResult:
    """Play a schedule with the given durations; see `PipelineResult`.

    Args:
        actions: a `PipelineSchedule`, torch's `{rank: [actions]}` or per-rank lists (Actions
            or strings such as `"0F1"`).
        t_f, t_b, t_w: forward, input-gradient backward and weight-gradient backward time of
            one microbatch on one stage. A full backward `BW` takes `t_b + t_w`.
        t_comm: time of one activation / gradient transfer between two ranks.
        t_fb: time of an overlapped `FB` action (a forward and a full backward run together,
            DualPipe's F&B); by default its parts back to back, `t_f + t_b + t_w` (no overlap
            gain). DeepSeek-V3's DualPipe bubble `(p/2 - 1)(F&B + B - 3W)` (B there is a full
            backward) reads `(p/2 - 1)(t_fb + t_b - 2 t_w)` here.
        t_send: the sending rank's own time per cross-rank message (see the module docstring).
    """
    checked = (("t_f", t_f), ("t_b", t_b), ("t_w", t_w), ("t_comm", t_comm), ("t_fb", t_fb), ("t_send", t_send))
    for label, value in checked:
        if value is not None and not value >= 0:
            raise ValueError(f"{label} must be >= 0, got {value!r}")
    schedule = validate(actions)  # a deadlock is reported by the actions it names
    return _Model(schedule, t_f, t_b, t_w, t_comm, t_fb, t_send).play()


class _Model:
    """Builds the event-engine spans of a schedule and plays them."""

    def __init__(self, schedule: PipelineSchedule, t_f, t_b, t_w, t_comm, t_fb, t_send=0.0):
        self.schedule = schedule
        self.duration = {"F": t_f, "B": t_b, "W": t_w, "BW": t_b + t_w, "SEND_F": t_send, "SEND_B": t_send}
        self.t_comm = t_comm
        self.t_fb = t_fb
        self.t_send = t_send
        self.stage_rank = {c.stage: r for r, row in enumerate(schedule.ranks) for a in row for c in a.computes}
        self.explicit_sends = any(a.kind in ("SEND_F", "SEND_B") for row in schedule.ranks for a in row)

    def _sends(self, rank: int, action: Action) -> int:
        """How many of `action`'s computes send their output to another rank."""
        if self.explicit_sends or not self.t_send:
            return 0
        to = {"F": 1, "B": -1, "BW": -1}
        return sum(self.stage_rank.get(c.stage + to[c.kind], rank) != rank for c in action.computes if c.kind in to)

    def _cost(self, action: Action, rank: int = 0) -> float:
        sends = self._sends(rank, action) * self.t_send
        if action.kind == "FB":
            return sends + (self.t_fb if self.t_fb is not None else sum(self.duration[p.kind] for p in action.parts))
        return sends + self.duration.get(action.kind, 0.0)

    def play(self) -> PipelineResult:
        graph = schedule_graph(self.schedule)
        engine = EventEngine()
        for r in range(self.schedule.num_ranks):
            engine.resource(f"rank {r}")
        span: dict[tuple[str, int], int] = {}
        rank_spans: list[tuple[int, Action, int]] = []
        for index, (r, action) in enumerate(graph.actions):
            span[("action", index)] = engine.add(("rank", r, index), self._cost(action, r), [f"rank {r}"])
            rank_spans.append((r, action, span[("action", index)]))
        links: set[str] = set()
        for index, transfer in enumerate(graph.transfers):
            link = f"link {transfer.src}->{transfer.dst}"
            if link not in links:
                engine.resource(link, "first_come")
                links.add(link)
            span[("transfer", index)] = engine.add(("transfer", transfer.what), self.t_comm, [link])
        for wait in graph.waits:
            engine.after(span[wait.consumer], span[wait.producer], at=wait.at, reason=wait.reason)
        return self._result(engine.run(), rank_spans)

    def _result(self, timeline: Timeline, rank_spans) -> PipelineResult:
        n = self.schedule.num_ranks
        spans = tuple(
            PipelineSpan(
                r,
                str(a),
                a.computes[0].microbatch if a.computes else a.microbatch,
                timeline.start[i],
                timeline.end[i],
                a.short,
            )
            for r, a, i in rank_spans
        )
        busy = [0.0] * n
        first = [float("inf")] * n
        last = [float("-inf")] * n
        for s in spans:
            busy[s.rank] += s.end - s.start
            first[s.rank] = min(first[s.rank], s.start)
            last[s.rank] = max(last[s.rank], s.end)
        makespan = max(last) - min(first) if spans else 0.0
        inner = [(last[r] - first[r] - busy[r]) if last[r] >= first[r] else 0.0 for r in range(n)]
        return PipelineResult(
            makespan=makespan,
            bubble=makespan - min(busy) if spans else 0.0,
            bubble_without_sync=max(inner, default=0.0),
            busy=tuple(busy),
            peak_activations=tuple(peak_activations(row) for row in self.schedule.ranks),
            spans=spans,
            name=self.schedule.name,
        )


def measured_result(per_rank: Sequence[Sequence[PipelineSpan]], name: str = "") -> PipelineResult:
    """The ranks' measured spans of one step as a `PipelineResult` (times from the first start)."""
    spans = [s for rank in per_rank for s in rank]
    if not spans:
        raise ValueError("no compute spans to measure")
    origin = min(s.start for s in spans)
    shifted = tuple(
        PipelineSpan(s.rank, s.action, s.microbatch, s.start - origin, s.end - origin, s.label) for s in spans
    )
    makespan = max(s.end for s in shifted)
    busy, inner, peaks = [], [], []
    for rank_spans in per_rank:
        work = sum(s.end - s.start for s in rank_spans)
        busy.append(work)
        inner.append(max(s.end for s in rank_spans) - min(s.start for s in rank_spans) - work if rank_spans else 0.0)
        peaks.append(peak_activations([Action.parse(s.action) for s in rank_spans]))
    return PipelineResult(
        makespan=makespan,
        bubble=makespan - min(busy),
        bubble_without_sync=max(inner),
        busy=tuple(busy),
        peak_activations=tuple(peaks),
        spans=shifted,
        name=name,
    )


def simulate_measured(
    orders: Any, per_rank: Sequence[Sequence[PipelineSpan]], t_comm: float = 0.0, t_send: float = 0.0
) -> PipelineResult:
    """`simulate()` of the compute orders `orders` (`ResolvedSchedule.compute_orders()`) with
    the means of the measured F, B (input gradient) and W spans of every rank (a full backward,
    BW, counts as B with no W), in the spans' unit (seconds), plus the transfer time `t_comm`
    and the sending rank's time per message `t_send`. Means rather than medians: a step pays
    every span, so a long one counts by its whole length."""
    durations: dict[str, list[float]] = {}
    for span in (s for rank in per_rank for s in rank):
        durations.setdefault(Action.parse(span.action).kind, []).append(span.end - span.start)
    means = {kind: statistics.mean(v) for kind, v in durations.items()}
    t_b = means.get("B", means.get("BW", 0.0))
    return simulate(orders, means.get("F", 0.0), t_b, means.get("W", 0.0), t_comm=t_comm, t_send=t_send)
