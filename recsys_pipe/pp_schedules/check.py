"""What makes a pipeline-parallel schedule runnable, shared by the runtime (`recsys_pipe.pp`,
which refuses a schedule it cannot run before anything starts) and the analysis
(`recsys_pipe.autosched.pipeline_parallel`, which times one): the structure checks, the
dependencies between a schedule's actions (`schedule_graph`) and the deadlock check that plays
them in order (`validate`).

Dependencies are derived from the actions: a microbatch's *route* is the stages its forwards
run on, in stage order. `F` of a stage waits for `F` of the previous stage on the route; `B`
(or `BW`) waits for its own `F` and for the backward of the next stage on the route; `W` waits
for its `B`. Each stage lives on one rank; each rank runs its actions in list order. Between
ranks, an activation or gradient is one transfer on the link between them; with explicit
`SEND_*`/`RECV_*` actions the transfer starts once both the send and the receive are posted,
otherwise when the producer ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from recsys_pipe.pp_schedules.actions import Action, PipelineSchedule

__all__ = ["PipelineScheduleError", "ScheduleGraph", "Transfer", "Wait", "as_schedule", "schedule_graph", "validate"]

Schedule = PipelineSchedule | Mapping | Sequence


class PipelineScheduleError(ValueError):
    """A malformed or deadlocking pipeline schedule; the message names the actions."""


@dataclass(frozen=True)
class Transfer:
    """An activation or gradient going from rank `src` to rank `dst`; `what` names it
    (`activation 0->1 of microbatch 3`)."""

    what: str
    src: int
    dst: int


#: a node of the graph: ("action", index into `ScheduleGraph.actions`) or ("transfer", index)
Node = tuple[str, int]


@dataclass(frozen=True)
class Wait:
    """`consumer` starts after `producer` ends (`at="end"`) or starts (`at="start"`)."""

    consumer: Node
    producer: Node
    at: Literal["end", "start"]
    reason: str


@dataclass(frozen=True)
class ScheduleGraph:
    """A schedule's actions (rank by rank, each rank's in its order), its transfers between
    ranks, and what waits for what."""

    actions: tuple[tuple[int, Action], ...]
    transfers: tuple[Transfer, ...]
    waits: tuple[Wait, ...]

    def label(self, node: Node) -> str:
        """`rank 1: 1B0` for an action, the transfer's `what` for a transfer."""
        kind, index = node
        if kind == "action":
            rank, action = self.actions[index]
            return _label(rank, action)
        return self.transfers[index].what


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
    schedule = as_schedule(actions)
    _check_deadlock(schedule_graph(schedule))
    return schedule


def as_schedule(actions: Schedule) -> PipelineSchedule:
    """`actions` as a `PipelineSchedule` whose structure is sound (`PipelineScheduleError` if not)."""
    try:
        schedule = PipelineSchedule.of(actions)
    except ValueError as exc:
        raise PipelineScheduleError(str(exc)) from None
    _check_structure(schedule)
    return schedule


def schedule_graph(schedule: PipelineSchedule) -> ScheduleGraph:
    """The actions, transfers and waits of a structurally sound `schedule` (see the module
    docstring). Transfers and waits come in route order, microbatch by microbatch."""
    actions: list[tuple[int, Action]] = []
    node_of: dict[tuple[str, int, int | None], Node] = {}  # compute or comm step -> its action
    for r, row in enumerate(schedule.ranks):
        for action in row:
            node = ("action", len(actions))
            actions.append((r, action))
            for c in action.computes or (action,):
                node_of[(c.kind, c.stage, c.microbatch)] = node
    stage_rank = {c.stage: r for r, a in actions for c in a.computes}
    routes = _routes({k: None for k in node_of if k[0] == "F"})
    transfers: list[Transfer] = []
    waits: list[Wait] = []

    def backward_of(stage: int, mb: int) -> Node | None:
        return node_of.get(("BW", stage, mb), node_of.get(("B", stage, mb)))

    def hop(producer, consumer, send, recv, src_stage, dst_stage, what: str) -> None:
        src, dst = stage_rank[src_stage], stage_rank[dst_stage]
        if src == dst:
            waits.append(Wait(consumer, producer, "end", what))
            return
        transfer = ("transfer", len(transfers))
        transfers.append(Transfer(what, src, dst))
        sent = node_of.get(send)
        if sent is not None:
            waits.append(Wait(transfer, sent, "start", what))
        else:
            waits.append(Wait(transfer, producer, "end", what))
        received = node_of.get(recv)
        if received is not None:
            waits.append(Wait(transfer, received, "start", f"{what} posted"))
        waits.append(Wait(consumer, transfer, "end", what))

    for mb, route in routes.items():
        for k, stage in enumerate(route):
            f = node_of[("F", stage, mb)]
            if k > 0:
                prev = route[k - 1]
                what = f"activation {prev}->{stage} of microbatch {mb}"
                hop(node_of[("F", prev, mb)], f, ("SEND_F", prev, mb), ("RECV_F", stage, mb), prev, stage, what)
            back = backward_of(stage, mb)
            if back is None:
                continue
            if back != f:
                waits.append(Wait(back, f, "end", "own forward"))
            if k + 1 < len(route):
                nxt = route[k + 1]
                what = f"gradient {nxt}->{stage} of microbatch {mb}"
                hop(backward_of(nxt, mb), back, ("SEND_B", nxt, mb), ("RECV_B", stage, mb), nxt, stage, what)
            w = node_of.get(("W", stage, mb))
            if w is not None and w != node_of[("B", stage, mb)]:
                waits.append(Wait(w, node_of[("B", stage, mb)], "end", "own input backward"))
        for kind in ("SEND_F", "SEND_B"):  # a send goes out after the compute that made it
            for stage in route:
                send = node_of.get((kind, stage, mb))
                made = node_of[("F", stage, mb)] if kind == "SEND_F" else backward_of(stage, mb)
                if send is not None and made is not None and send != made:
                    waits.append(Wait(send, made, "end", "sends what it computed"))
    return ScheduleGraph(tuple(actions), tuple(transfers), tuple(waits))


def _check_deadlock(graph: ScheduleGraph) -> None:
    """Play the graph in order (each rank its actions one after another, each transfer once
    what it waits for ran); PipelineScheduleError naming, per rank, the first action that can
    never run and what it waits for."""
    needs: dict[Node, list[Node]] = {}
    for wait in graph.waits:
        needs.setdefault(wait.consumer, []).append(wait.producer)
    rows: dict[int, list[Node]] = {}
    for index, (rank, _) in enumerate(graph.actions):
        rows.setdefault(rank, []).append(("action", index))
    done: set[Node] = set()
    pending = [("transfer", j) for j in range(len(graph.transfers))]
    position = dict.fromkeys(rows, 0)
    moved = True
    while moved:
        moved = False
        for node in [t for t in pending if all(n in done for n in needs.get(t, ()))]:
            done.add(node)
            pending.remove(node)
            moved = True
        for rank, row in rows.items():
            while position[rank] < len(row) and all(n in done for n in needs.get(row[position[rank]], ())):
                done.add(row[position[rank]])
                position[rank] += 1
                moved = True
    stuck = {rank: row[position[rank]] for rank, row in sorted(rows.items()) if position[rank] < len(row)}
    if not stuck:
        return
    parts = []
    for rank, node in stuck.items():
        names = []
        for wait in (n for n in needs.get(node, ()) if n not in done):
            if wait[0] == "transfer":  # name the action that would send it
                senders = [graph.label(n) for n in needs.get(wait, ()) if n not in done and n[0] == "action"]
                names.append(f"{' / '.join(senders) or 'a transfer'} ({graph.label(wait)})")
            elif graph.actions[wait[1]][0] != rank:
                names.append(graph.label(wait))
        parts.append(f"{graph.label(node)} waits for {', '.join(names) or 'an earlier action of its own rank'}")
    raise PipelineScheduleError("deadlock: no rank can proceed; " + "; ".join(parts))


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
