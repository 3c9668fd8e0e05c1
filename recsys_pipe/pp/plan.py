"""Single-stage-per-rank pipeline schedules as engine plans over microbatches.

Per rank, a schedule is a plan whose "batches" are the microbatches of one optimizer step: one
ring slot per microbatch, and the engine's prefill / steady state / drain are the schedule's
warm-up / steady state / cool-down. Tasks (stage r of p; lookaheads in microbatches):

| schedule | F | B | W | |
|---|---|---|---|---|
| gpipe | m - 1 | 0 (full backward `BW`) | | every forward before any backward |
| 1f1b | p - 1 - r | 0 (`BW`) | | |
| zb_h1 | p - 1 | r | 0 | W held back r microbatches behind B |
| zb_h2 | 2(p - 1) | 2r | 0 | twice the warm-up, W held back 2r |

Relative to B, F runs `p-1-r` (zb_h1) or `2(p-1-r)` (zb_h2) microbatches ahead, as in the
Zero Bubble paper's handcrafted schedules; lookaheads are shifted so the smallest is 0. Inside
one engine iteration the tasks run F, then B, then W, so the firing order is exactly
`recsys_pipe.autosched.pp_schedules.build()`'s per-rank action order (a test checks it).

Around the compute tasks, `recv_F` / `send_F` move the activations (same lookahead as F) and
`recv_B` / `send_B` the input gradients (same lookahead as B). Data moves through slots of the
microbatch's store: `act_in` -> F -> `fwd` -> B -> `bwd` -> W.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from recsys_pipe.engine import BATCH_CPU, STEP_RESULT, SchedulablePipeline, Schedule, Task, TaskContext

__all__ = ["SCHEDULES", "StagePlan", "firing_order", "stage_plan", "stage_schedule", "stage_tasks"]

#: the schedules a single stage per rank runs as an engine plan
SCHEDULES = ("gpipe", "1f1b", "zb_h1", "zb_h2")


@dataclass(frozen=True)
class StagePlan:
    """The lookaheads of one rank's stage tasks. `weight` is None when B and W run as one
    full backward (`BW`)."""

    schedule: str
    num_stages: int
    stage: int
    microbatches: int
    forward: int
    backward: int
    weight: int | None

    @property
    def split_backward(self) -> bool:
        """Whether backward runs as input gradient (B) and weight gradient (W) tasks, zero-bubble style."""
        return self.weight is not None

    @property
    def ring_slots(self) -> int:
        """Microbatches in flight on this rank (the ring's depth)."""
        return self.forward + 1


def stage_plan(schedule: str, num_stages: int, stage: int, microbatches: int) -> StagePlan:
    """The plan of stage `stage` of `num_stages` for `schedule` over `microbatches`."""
    p, r, m = num_stages, stage, microbatches
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown single-stage pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if p < 1 or not 0 <= r < p or m < 1:
        raise ValueError(f"need 0 <= stage < num_stages and microbatches >= 1, got stage={r}, p={p}, m={m}")
    lookaheads = {
        "gpipe": (m - 1, 0, None),
        "1f1b": (p - 1 - r, 0, None),
        "zb_h1": (p - 1, r, 0),
        "zb_h2": (2 * (p - 1), 2 * r, 0),
    }[schedule]
    return StagePlan(schedule, p, r, m, *lookaheads)


# -- task functions: ctx.state is the rank's StageRuntime, ctx.batch_index the microbatch -------


def recv_f(ctx: TaskContext) -> None:
    ctx.slots.set("act_in", ctx.state.recv_activation(ctx.batch_index))


def forward(ctx: TaskContext) -> None:
    slots = ctx.slots
    slots.set("fwd", ctx.state.forward(ctx.batch_index, slots[BATCH_CPU], slots.pop("act_in", ())))


def send_f(ctx: TaskContext) -> None:
    ctx.state.send_activation(ctx.slots["fwd"])


def recv_b(ctx: TaskContext) -> None:
    ctx.slots.set("grad_in", ctx.state.recv_gradient(ctx.batch_index))


def backward_input(ctx: TaskContext) -> None:
    slots = ctx.slots
    slots.set("bwd", ctx.state.backward_input(slots.pop("fwd"), slots.pop("grad_in", None)))


def backward_weight(ctx: TaskContext) -> None:
    record = ctx.slots.pop("bwd")
    ctx.state.backward_weight(record)
    ctx.slots.set(STEP_RESULT, record.forward.loss)


def backward(ctx: TaskContext) -> None:
    slots = ctx.slots
    record = ctx.state.backward(slots.pop("fwd"), slots.pop("grad_in", None))
    slots.set("bwd", record)
    slots.set(STEP_RESULT, record.forward.loss)


def send_b(ctx: TaskContext) -> None:
    ctx.state.send_gradient(ctx.slots["bwd"])


def stage_tasks(plan: StagePlan) -> tuple[Task, ...]:
    """The rank's tasks, in the order they run inside one engine iteration."""
    first, last = plan.stage == 0, plan.stage == plan.num_stages - 1
    f, b = plan.forward, plan.backward
    tasks = []
    if not first:
        tasks.append(Task.from_fn("recv_F", recv_f, lookahead=f, writes=["act_in"]))
    f_reads = [BATCH_CPU] if first else [BATCH_CPU, "act_in"]
    tasks.append(Task.from_fn("F", forward, lookahead=f, reads=f_reads, writes=["fwd"]))
    if not last:
        tasks.append(Task.from_fn("send_F", send_f, lookahead=f, reads=["fwd"]))
        tasks.append(Task.from_fn("recv_B", recv_b, lookahead=b, reads=["fwd"], writes=["grad_in"]))
    b_reads = ["fwd"] if last else ["fwd", "grad_in"]
    if plan.split_backward:
        tasks.append(Task.from_fn("B", backward_input, lookahead=b, reads=b_reads, writes=["bwd"]))
    else:
        tasks.append(Task.from_fn("BW", backward, lookahead=b, reads=b_reads, writes=["bwd", STEP_RESULT]))
    if not first:
        tasks.append(Task.from_fn("send_B", send_b, lookahead=b, reads=["bwd"]))
    if plan.split_backward:
        tasks.append(Task.from_fn("W", backward_weight, lookahead=plan.weight, reads=["bwd"], writes=[STEP_RESULT]))
    return tuple(tasks)


def stage_schedule(plan: StagePlan) -> Schedule:
    """The rank's engine schedule (one stage, the default stream)."""
    return Schedule.single_stage(stage_tasks(plan))


class _DryStage:
    """Stands in for a StageRuntime: runs nothing, logs the task of each call, passes records on."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def _record(self, kind: str, microbatch: int) -> Any:
        self.log.append((kind, microbatch))
        return SimpleNamespace(
            microbatch=microbatch, loss=None, forward=SimpleNamespace(microbatch=microbatch, loss=None)
        )

    def recv_activation(self, microbatch: int) -> tuple:
        self._record("recv_F", microbatch)
        return ()

    def forward(self, microbatch: int, batch: Any, inputs: tuple) -> Any:
        return self._record("F", microbatch)

    def send_activation(self, record: Any) -> None:
        self._record("send_F", record.microbatch)

    def recv_gradient(self, microbatch: int) -> tuple:
        self._record("recv_B", microbatch)
        return ()

    def backward_input(self, record: Any, grads: Any) -> Any:
        return self._record("B", record.microbatch)

    def backward(self, record: Any, grads: Any) -> Any:
        return self._record("BW", record.microbatch)

    def backward_weight(self, record: Any) -> None:
        self._record("W", record.forward.microbatch)

    def send_gradient(self, record: Any) -> None:
        self._record("send_B", record.forward.microbatch)


def firing_order(plan: StagePlan) -> list[tuple[str, int]]:
    """(task, microbatch) in the order the engine runs `plan` over one step, found by running
    it on the engine with a stand-in stage that computes nothing."""
    dry = _DryStage()
    with SchedulablePipeline(stage_schedule(plan), state=dry) as pipeline:
        for _ in pipeline.iterate(iter(range(plan.microbatches))):
            pass
    return dry.log
