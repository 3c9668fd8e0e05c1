"""Schedules with several stages per rank (interleaved 1F1B, ZBV, DualPipeV, any CSV in
torch's format) as a static per-rank action order run by the engine.

These schedules are not a lookahead pattern over one stage, so each rank's action list is
compiled into a one-iteration engine plan: one task per action, in the listed order, all at
lookahead 0, one engine iteration per optimizer step (its batch: the step's microbatches).
Data flows through slots named by stage and microbatch, so the engine checks the list as it
checks any plan (every read has a writer) and the observer sees every action as a task:

- `<s>F<j>` (forward of stage s, microbatch j) reads `in:<s>:<j>` (none on the first stage) and
  writes `fwd:<s>:<j>`; when stage s+1 lives on this rank it also hands its outputs over as
  `in:<s+1>:<j>`, else `<s>SEND_F<j>` sends them;
- `<s>RECV_F<j>` receives `in:<s>:<j>` when stage s-1 lives on another rank;
- `<s>I<j>` (input gradient, our B) or `<s>B<j>` (full backward, our BW) reads `fwd:<s>:<j>`
  and `grad:<s>:<j>` (none on the last stage), writes `bwd:<s>:<j>` and, for stage s-1 on this
  rank, `grad:<s-1>:<j>`; else `<s>SEND_B<j>` sends the gradient, `<s-1>RECV_B<j>` receives it;
- `<s>W<j>` (weight gradient) reads `bwd:<s>:<j>`.

An overlapped pair (DualPipeV's `OVERLAP_F_B`) runs its forward, then its backward. A list
whose order contradicts its data flow (a backward before its forward) is refused: the engine
would have to reorder it.

Each step first posts the receives of all its `RECV_*` actions (`PeerLink.post_recv`: their
headers, and on a speculative link their payloads), so a peer's send finds them posted and goes
out at once instead of waiting for the receive task (see `recsys_pipe.pp.p2p`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from recsys_pipe.engine import (
    BATCH_CPU,
    STEP_RESULT,
    PlanRunner,
    Task,
    TaskContext,
    TaskGraph,
    TaskGraphValidationError,
    TaskObserver,
    compile_dependencies,
)
from recsys_pipe.pp.p2p import PeerLink
from recsys_pipe.pp.stage import StageRuntime, as_stage_input
from recsys_pipe.pp_schedules.actions import Action, PipelineSchedule

__all__ = ["ActionOrderRunner", "Site", "action_schedule", "stage_ranks"]


def stage_ranks(num_ranks: int, stages_per_rank: int, style: Literal["loop", "v"]) -> tuple[int, ...]:
    """The rank of each stage: `loop` puts stage s on rank s mod p (interleaved schedules),
    `v` folds the stages back (stage s and 2p-1-s share a rank: ZBV, DualPipeV)."""
    num_stages = num_ranks * stages_per_rank
    if style == "loop":
        return tuple(s % num_ranks for s in range(num_stages))
    if style == "v":
        if stages_per_rank != 2:
            raise ValueError(f"a V layout has 2 stages per rank, got {stages_per_rank}")
        return tuple(s if s < num_ranks else num_stages - 1 - s for s in range(num_stages))
    raise ValueError(f"unknown stage layout {style!r}: 'loop' or 'v'")


@dataclass(frozen=True)
class Site:
    """Where an action task works (its `Task.options`): stage, microbatch, and the number of
    stages, to know the pipeline's ends."""

    stage: int
    microbatch: int
    num_stages: int

    def key(self, prefix: str, stage: int | None = None) -> str:
        """The slot name of `prefix` (in, act, grad...) for this microbatch at `stage` (default: this site's)."""
        return f"{prefix}:{self.stage if stage is None else stage}:{self.microbatch}"


# -- task functions: ctx.state maps stage -> StageRuntime ---------------------------------------


def _site(ctx: TaskContext) -> tuple[Site, StageRuntime]:
    site: Site = ctx.task.options
    return site, ctx.state[site.stage]


def recv_f(ctx: TaskContext) -> None:
    site, runtime = _site(ctx)
    ctx.slots.set(site.key("in"), runtime.recv_activation(site.microbatch))


def forward(ctx: TaskContext) -> None:
    site, runtime = _site(ctx)
    slots = ctx.slots
    inputs = slots.pop(site.key("in")) if site.stage > 0 else ()
    record = runtime.forward(site.microbatch, slots[BATCH_CPU][site.microbatch], inputs)
    slots.set(site.key("fwd"), record)
    if site.stage + 1 in ctx.state:  # the next stage is on this rank: hand the outputs over
        slots.set(site.key("in", site.stage + 1), as_stage_input(record.outputs))
    if record.loss is not None:
        slots.set(site.key("loss"), record.loss)


def send_f(ctx: TaskContext) -> None:
    site, runtime = _site(ctx)
    runtime.send_activation(ctx.slots[site.key("fwd")])


def recv_b(ctx: TaskContext) -> None:
    site, runtime = _site(ctx)
    ctx.slots.set(site.key("grad"), runtime.recv_gradient(site.microbatch))


def _backward(ctx: TaskContext, full: bool) -> None:
    site, runtime = _site(ctx)
    slots = ctx.slots
    grads = slots.pop(site.key("grad")) if site.stage < site.num_stages - 1 else None
    record = slots.pop(site.key("fwd"))
    done = runtime.backward(record, grads) if full else runtime.backward_input(record, grads)
    slots.set(site.key("bwd"), done)
    if site.stage - 1 in ctx.state:  # the previous stage is on this rank: hand the gradient over
        slots.set(site.key("grad", site.stage - 1), done.input_grads)


def backward_input(ctx: TaskContext) -> None:
    _backward(ctx, full=False)


def backward(ctx: TaskContext) -> None:
    _backward(ctx, full=True)


def send_b(ctx: TaskContext) -> None:
    site, runtime = _site(ctx)
    runtime.send_gradient(ctx.slots[site.key("bwd")])


def backward_weight(ctx: TaskContext) -> None:
    site, runtime = _site(ctx)
    runtime.backward_weight(ctx.slots.pop(site.key("bwd")))


def step_losses(ctx: TaskContext) -> None:
    """The last task: the step's result is the last stage's losses in microbatch order (its
    options: their slot names, or the number of microbatches where the last stage is elsewhere)."""
    names = ctx.task.options
    losses = [None] * names if isinstance(names, int) else [ctx.slots[name] for name in names]
    ctx.slots.set(STEP_RESULT, losses)


# -- building a rank's plan ----------------------------------------------------------------------


def _compute_actions(actions: Sequence[Action]) -> list[Action]:
    out = []
    for action in actions:
        out.extend(action.computes)  # an overlapped pair runs its forward, then its backward
    return out


def action_schedule(
    schedule: PipelineSchedule, rank: int, ranks_of_stages: Sequence[int], microbatches: int
) -> TaskGraph:
    """Rank `rank`'s actions of `schedule` as a one-iteration engine plan (see the module
    docstring). ValueError when the list does not fit: a stage of another rank, a microbatch
    out of range, an action before what it needs."""
    num_stages = len(ranks_of_stages)
    local = {s for s, r in enumerate(ranks_of_stages) if r == rank}
    tasks: list[Task] = []

    def add(name: str, fn: Any, site: Site, reads: Sequence[str] = (), writes: Sequence[str] = ()) -> None:
        tasks.append(Task.from_fn(name, fn, reads=list(reads), writes=list(writes), options=site))

    for action in _compute_actions(schedule.ranks[rank]):
        s, j = action.stage, action.microbatch
        if s not in local or not 0 <= j < microbatches:
            where = f"stage {s} is on rank {ranks_of_stages[s]}" if 0 <= s < num_stages else f"no stage {s}"
            raise ValueError(f"rank {rank}: action {action} does not fit ({where}; microbatches 0..{microbatches - 1})")
        site = Site(s, j, num_stages)
        first, last = s == 0, s == num_stages - 1
        if action.kind == "F":
            if not first and s - 1 not in local:
                add(f"{s}RECV_F{j}", recv_f, site, writes=[site.key("in")])
            writes = [site.key("fwd")]
            if not last and s + 1 in local:
                writes.append(site.key("in", s + 1))
            if last:
                writes.append(site.key("loss"))
            add(str(action), forward, site, reads=[BATCH_CPU] + ([] if first else [site.key("in")]), writes=writes)
            if not last and s + 1 not in local:
                add(f"{s}SEND_F{j}", send_f, site, reads=[site.key("fwd")])
        elif action.kind in ("B", "BW"):
            if not last and s + 1 not in local:
                add(f"{s}RECV_B{j}", recv_b, site, writes=[site.key("grad")])
            reads = [site.key("fwd")] + ([] if last else [site.key("grad")])
            writes = [site.key("bwd")] + ([site.key("grad", s - 1)] if not first and s - 1 in local else [])
            add(str(action), backward if action.kind == "BW" else backward_input, site, reads=reads, writes=writes)
            if not first and s - 1 not in local:
                add(f"{s}SEND_B{j}", send_b, site, reads=[site.key("bwd")])
        else:  # W
            add(str(action), backward_weight, site, reads=[site.key("bwd")])
    losses = tuple(f"loss:{num_stages - 1}:{j}" for j in range(microbatches)) if num_stages - 1 in local else ()
    tasks.append(
        Task.from_fn("losses", step_losses, reads=list(losses), writes=[STEP_RESULT], options=losses or microbatches)
    )
    plan = TaskGraph.single_group(tasks)
    try:
        order = compile_dependencies(plan).order
    except TaskGraphValidationError as exc:
        raise ValueError(f"rank {rank}: the action list does not fit: {exc}") from None
    for declared, compiled in zip(tasks, order, strict=True):
        if declared is not compiled:
            raise ValueError(f"rank {rank}: action {declared.name} runs before what it needs ({compiled.name})")
    return plan


def _post_receive(task: Task, runtimes: Mapping[int, StageRuntime]) -> None:
    """Post the receive a `RECV_F` / `RECV_B` task completes (see the module docstring)."""
    site: Site = task.options
    runtime = runtimes[site.stage]
    if task.fn is recv_f:
        runtime.post_recv_activation(site.microbatch)
    else:
        runtime.post_recv_gradient(site.microbatch)


class ActionOrderRunner:
    """Runs rank `rank`'s action list of `schedule`, one optimizer step per `run_step` call.

    Args:
        runtimes: this rank's stages, `{stage: StageRuntime}`.
        schedule: every rank's action list (a torch CSV read with `from_csv`, a torch
            schedule's `pipeline_order`, ...).
        ranks_of_stages: the rank of each stage (`stage_ranks`).
        microbatches: microbatches per step.
    """

    def __init__(
        self,
        runtimes: Mapping[int, StageRuntime],
        schedule: PipelineSchedule,
        rank: int,
        ranks_of_stages: Sequence[int],
        microbatches: int,
        *,
        link: PeerLink | None = None,
        observer: TaskObserver | None = None,
    ):
        self.runtimes = dict(runtimes)
        self.microbatches = microbatches
        self.link = link
        plan = action_schedule(schedule, rank, ranks_of_stages, microbatches)
        self.plan_runner = PlanRunner(plan, state=self.runtimes, observer=observer)
        #: the receive tasks, posted at the start of a step
        self.receives = [task for task in plan.tasks if task.fn is recv_f or task.fn is recv_b]

    def run_step(self, step: int, microbatches: Sequence[Any]) -> list[torch.Tensor | None]:
        """Every action of one step; returns the last stage's microbatch losses (None where the
        last stage is on another rank). The stages' `.grad` then hold the microbatch mean."""
        if len(microbatches) != self.microbatches:
            raise ValueError(f"the plan is for {self.microbatches} microbatches, got {len(microbatches)}")
        for runtime in self.runtimes.values():
            runtime.begin_step(step, len(microbatches))
        for task in self.receives:
            _post_receive(task, self.runtimes)
        losses = self.plan_runner.progress(iter([list(microbatches)]))
        if self.link is not None:
            self.link.wait_sends()
        for _, runtime in sorted(self.runtimes.items()):  # the same collective order on every replica
            runtime.end_step(len(microbatches))
        return losses

    def shutdown(self) -> None:
        """Stop the plan runner's worker threads."""
        self.plan_runner.shutdown()
