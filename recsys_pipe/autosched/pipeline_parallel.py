"""Pipeline-parallel schedules: build, check and time them with the plan simulator's event engine.

`build(name, p, m)` makes 1F1B, ZB-H1, ZB-H2 or DualPipe (see `pp_schedules`); `from_csv` reads
a schedule written by `torch.distributed.pipelining` (and `to_csv` writes one), so a torch
schedule can be timed with measured durations; `validate` checks a schedule; `simulate` plays
it and reports its makespan and bubble.

Dependencies are derived from the actions: a microbatch's *route* is the stages its forwards
run on, in stage order. `F` of a stage waits for `F` of the previous stage on the route; `B`
(or `BW`) waits for its own `F` and for the backward of the next stage on the route; `W` waits
for its `B`. Each stage lives on one rank; each rank runs its actions in list order, one at a
time. Between ranks, an activation or gradient is one transfer of `t_comm` on the directed link
between them (first come, first served); with explicit `SEND_*`/`RECV_*` actions the transfer
starts once both the send and the receive are posted, otherwise when the producer ends.
Sending can also cost the sending rank time (`t_send`: posting the message, or writing it out
when its receive is posted): each `SEND_*` action takes it, or, without those, each compute
whose activation or gradient goes to another rank takes it on top of its own duration.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from recsys_pipe.autosched.events import Deadlock, EventEngine, Timeline
from recsys_pipe.autosched.pp_actions import Action, PipelineSchedule, from_csv, to_csv
from recsys_pipe.autosched.pp_schedules import SCHEDULES, build

__all__ = [
    "SCHEDULES",
    "Action",
    "PipelineResult",
    "PipelineSchedule",
    "PipelineScheduleError",
    "PipelineSpan",
    "build",
    "from_csv",
    "peak_activations",
    "simulate",
    "to_csv",
    "validate",
]

Schedule = PipelineSchedule | Mapping | Sequence


class PipelineScheduleError(ValueError):
    """A malformed or deadlocking pipeline schedule; the message names the actions."""


@dataclass(frozen=True)
class PipelineSpan:
    """One action of one rank on the timeline."""

    rank: int
    action: str  #: torch's form, e.g. `0F3`
    microbatch: int | None
    start: float
    end: float
    label: str = ""  #: our short form, e.g. `F3`, `F3&BW7`


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


def validate(actions: Schedule) -> PipelineSchedule:
    """Check a schedule; return it as a `PipelineSchedule`, or raise `PipelineScheduleError`.

    Checks: every stage runs on one rank; every microbatch runs through as many stages as the
    others (its route: the stages of its forwards); the route has one forward per stage
    and a backward per stage (B and W, or BW), or no backward anywhere (forward-only); on its
    rank, each microbatch's F comes before its B, which comes before its W; communication
    actions, if any, pair up (a send after its compute, a receive on the next rank of the
    route); and the schedule cannot deadlock (a rank waiting for an action that can only run
    after the waiting one), detected by playing it and naming the stuck actions.
    """
    schedule = _as_schedule(actions)
    _Model(schedule, 1.0, 1.0, 1.0, 0.0, None).play()
    return schedule


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
    schedule = _as_schedule(actions)
    return _Model(schedule, t_f, t_b, t_w, t_comm, t_fb, t_send).play()


def _as_schedule(actions: Schedule) -> PipelineSchedule:
    try:
        schedule = PipelineSchedule.of(actions)
    except ValueError as exc:
        raise PipelineScheduleError(str(exc)) from None
    _check_structure(schedule)
    return schedule


def _label(rank: int, action: Action) -> str:
    return f"rank {rank}: {action}"


def _check_structure(schedule: PipelineSchedule) -> None:
    problems: list[str] = []
    stage_rank: dict[int, int] = {}
    seen: dict[tuple[str, int, int | None], tuple[int, int]] = {}  # (kind, stage, mb) -> (rank, position)
    for r, row in enumerate(schedule.ranks):
        for pos, action in enumerate(row):
            for c in action.computes or (action,):
                if c.kind in ("UNSHARD", "RESHARD", "REDUCE_GRAD"):
                    continue
                owner = stage_rank.setdefault(c.stage, r)
                if owner != r and c.kind not in ("RECV_F", "RECV_B"):
                    problems.append(f"{_label(r, action)}: stage {c.stage} already runs on rank {owner}")
                if c.kind in ("RECV_F", "RECV_B"):
                    continue
                key = (c.kind, c.stage, c.microbatch)
                if key in seen:
                    problems.append(f"rank {r}: {c} appears twice")
                seen.setdefault(key, (r, pos))
    for r, row in enumerate(schedule.ranks):  # receives belong on the receiving stage's rank
        for action in row:
            if action.kind in ("RECV_F", "RECV_B") and stage_rank.get(action.stage, r) != r:
                problems.append(f"{_label(r, action)}: stage {action.stage} runs on rank {stage_rank[action.stage]}")
    has_backward = any(k[0] in ("B", "BW", "W") for k in seen)
    routes = _routes(seen)
    for (kind, stage, mb), (r, _) in seen.items():
        if kind in ("B", "BW", "W") and stage not in routes.get(mb, ()):
            problems.append(f"rank {r}: {Action(kind, stage, mb)} has no forward {Action('F', stage, mb)}")
    lengths = {len(route) for route in routes.values()}
    if len(lengths) > 1:
        shortest = min(routes, key=lambda mb: (len(routes[mb]), mb))
        longest = max(routes, key=lambda mb: (len(routes[mb]), -mb))
        problems.append(
            f"microbatches run through different numbers of stages: microbatch {shortest} through "
            f"{routes[shortest]}, microbatch {longest} through {routes[longest]}"
        )
    for mb, route in sorted(routes.items()):
        for stage in route:
            r, f_pos = seen[("F", stage, mb)]
            f = Action("F", stage, mb)
            if not has_backward:
                continue
            full, split, weight = (seen.get((k, stage, mb)) for k in ("BW", "B", "W"))
            if full and (split or weight):
                problems.append(f"rank {r}: microbatch {mb} on stage {stage} has both BW and B/W")
            elif not full and not (split and weight):
                missing = "B" if not split else "W"
                problems.append(f"rank {r}: microbatch {mb} on stage {stage} has no {missing} (nor BW)")
            backward = full or split
            if backward and backward[1] < f_pos:
                problems.append(f"rank {r}: the backward of {f} comes before it")
            if split and weight and weight[1] < split[1]:
                problems.append(f"rank {r}: {Action('W', stage, mb)} comes before {Action('B', stage, mb)}")
    comms = [k for k in seen if k[0].startswith("SEND")]
    if comms or any(a.kind.startswith("RECV") for row in schedule.ranks for a in row):
        problems += _check_comms(schedule, seen, routes, stage_rank)
    if problems:
        more = f"\n  (and {len(problems) - 20} more)" if len(problems) > 20 else ""
        raise PipelineScheduleError("invalid pipeline schedule:\n  " + "\n  ".join(problems[:20]) + more)


def _routes(seen) -> dict[int, list[int]]:
    routes: dict[int, list[int]] = {}
    for kind, stage, mb in seen:
        if kind == "F":
            routes.setdefault(mb, []).append(stage)
    return {mb: sorted(stages) for mb, stages in routes.items()}


def _check_comms(schedule, seen, routes, stage_rank) -> list[str]:
    """With explicit communication, every cross-rank hop needs its send and its receive."""
    recvs = {(a.kind, a.stage, a.microbatch) for row in schedule.ranks for a in row if a.kind.startswith("RECV")}
    problems = []
    for mb, route in routes.items():
        for src, dst in zip(route, route[1:]):
            if stage_rank[src] == stage_rank[dst]:
                continue
            hops = [("SEND_F", src, "RECV_F", dst)]
            if ("BW", dst, mb) in seen or ("B", dst, mb) in seen:
                hops.append(("SEND_B", dst, "RECV_B", src))
            for send, s_stage, recv, r_stage in hops:
                if (send, s_stage, mb) not in seen:
                    problems.append(f"rank {stage_rank[s_stage]}: missing {Action(send, s_stage, mb)}")
                if (recv, r_stage, mb) not in recvs:
                    problems.append(f"rank {stage_rank[r_stage]}: missing {Action(recv, r_stage, mb)}")
    return problems


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
        schedule = self.schedule
        engine = EventEngine()
        span_of: dict[tuple[str, int, int | None], int] = {}  # compute or comm step -> span id
        labels: list[str] = []
        rank_spans: list[tuple[int, Action, int]] = []
        for r in range(schedule.num_ranks):
            engine.resource(f"rank {r}")
        for r, row in enumerate(schedule.ranks):
            for action in row:
                i = engine.add(("rank", r, len(labels)), self._cost(action, r), [f"rank {r}"])
                labels.append(_label(r, action))
                rank_spans.append((r, action, i))
                for c in action.computes or (action,):
                    span_of[(c.kind, c.stage, c.microbatch)] = i
        stage_rank = {c.stage: r for r, a, _ in rank_spans for c in a.computes}
        routes = _routes({k: None for k in span_of if k[0] == "F"})

        def backward_of(stage, mb):
            return span_of.get(("BW", stage, mb), span_of.get(("B", stage, mb)))

        links: set[str] = set()

        def hop(producer: int, consumer: int, send, recv, src_stage, dst_stage, what: str):
            src, dst = stage_rank[src_stage], stage_rank[dst_stage]
            if src == dst:
                engine.after(consumer, producer, reason=what)
                return
            link = f"link {src}->{dst}"
            if link not in links:
                engine.resource(link, "first_come")
                links.add(link)
            transfer = engine.add(("transfer", what), self.t_comm, [link])
            labels.append(what)
            sent = span_of.get(send)
            if sent is not None:
                engine.after(transfer, sent, at="start", reason=what)
            else:
                engine.after(transfer, producer, reason=what)
            received = span_of.get(recv)
            if received is not None:
                engine.after(transfer, received, at="start", reason=f"{what} posted")
            engine.after(consumer, transfer, reason=what)

        for mb, route in routes.items():
            for k, stage in enumerate(route):
                f = span_of[("F", stage, mb)]
                if k > 0:
                    prev = route[k - 1]
                    hop(
                        span_of[("F", prev, mb)],
                        f,
                        ("SEND_F", prev, mb),
                        ("RECV_F", stage, mb),
                        prev,
                        stage,
                        f"activation {prev}->{stage} of microbatch {mb}",
                    )
                back = backward_of(stage, mb)
                if back is None:
                    continue
                if back != f:
                    engine.after(back, f, reason="own forward")
                if k + 1 < len(route):
                    nxt = route[k + 1]
                    hop(
                        backward_of(nxt, mb),
                        back,
                        ("SEND_B", nxt, mb),
                        ("RECV_B", stage, mb),
                        nxt,
                        stage,
                        f"gradient {nxt}->{stage} of microbatch {mb}",
                    )
                w = span_of.get(("W", stage, mb))
                if w is not None and w != span_of[("B", stage, mb)]:
                    engine.after(w, span_of[("B", stage, mb)], reason="own input backward")
            for kind in ("SEND_F", "SEND_B"):  # a send goes out after the compute that made it
                for stage in route:
                    send = span_of.get((kind, stage, mb))
                    made = span_of[("F", stage, mb)] if kind == "SEND_F" else backward_of(stage, mb)
                    if send is not None and made is not None and send != made:
                        engine.after(send, made, reason="sends what it computed")
        try:
            timeline = engine.run()
        except Deadlock as exc:
            raise PipelineScheduleError(_deadlock_message(exc, labels, schedule)) from None
        return self._result(timeline, rank_spans)

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


def peak_activations(row: Sequence[Action]) -> int:
    """The most microbatches whose forward ran and whose backward (B or BW) has not, along one
    rank's action order."""
    held = peak = 0
    for action in row:
        for c in action.computes:  # an overlapped pair holds the new activation before freeing
            if c.kind == "F":
                held += 1
                peak = max(peak, held)
        held -= sum(c.kind in ("B", "BW") for c in action.computes)
    return peak


def _deadlock_message(exc: Deadlock, labels: list[str], schedule: PipelineSchedule) -> str:
    """Name, per rank, the first action that can never run and what it waits for."""
    stuck_by_rank: dict[int, tuple[int, list]] = {}
    for key, waits in exc.stuck.items():
        if key[0] != "rank":
            continue
        _, r, index = key
        if r not in stuck_by_rank or index < stuck_by_rank[r][0]:
            stuck_by_rank[r] = (index, waits)
    parts = []
    for r in sorted(stuck_by_rank):
        index, waits = stuck_by_rank[r]
        names = []
        for w in waits:
            if w[0] == "transfer":  # name the action that would send it
                senders = [labels[k[2]] for k in exc.stuck.get(w, ()) if k[0] == "rank"]
                names.append(f"{' / '.join(senders) or 'a transfer'} ({w[1]})")
            elif w[1] != r:
                names.append(labels[w[2]])
        parts.append(f"{labels[index]} waits for {', '.join(names) or 'an earlier action of its own rank'}")
    return "deadlock: no rank can proceed; " + "; ".join(parts)
