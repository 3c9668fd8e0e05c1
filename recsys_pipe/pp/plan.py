"""Single-stage-per-rank pipeline schedules as engine plans over microbatches.

Per rank, a schedule is a plan whose "batches" are the microbatches of one optimizer step: one
ring slot per microbatch, and the engine's prefill / steady state / drain are the schedule's
warm-up / steady state / cool-down. A schedule is declared in YAML: the lookaheads of F, B and W
as integer expressions in p (stages), r (this rank's stage) and m (microbatches), one file per
schedule in `recsys_pipe/pp/lookahead/` (or a file of the user's, `parallel.pp.schedule=my.yaml`).
The shipped files (stage r of p; lookaheads in microbatches):

| schedule | F | B | W | |
|---|---|---|---|---|
| gpipe | m - 1 | 0 (full backward `BW`) | | every forward before any backward |
| 1f1b | p - 1 - r | 0 (`BW`) | | |
| zb_h1 | p - 1 | r | 0 | W held back r microbatches behind B |
| zb_h2 | 2(p - 1) | 2r | 0 | twice the warm-up, W held back 2r |

Relative to B, F runs `p-1-r` (zb_h1) or `2(p-1-r)` (zb_h2) microbatches ahead, as in the
Zero Bubble paper's handcrafted schedules; lookaheads are shifted so the smallest is 0. Inside
one engine iteration the tasks run F, then B, then W, so the firing order is exactly
`recsys_pipe.pp_schedules.generators.build()`'s per-rank action order (a test checks it).

Around the compute tasks, `recv_F` / `send_F` move the activations (same lookahead as F) and
`recv_B` / `send_B` the input gradients (same lookahead as B). Data moves through slots of the
microbatch's store: `act_in` -> F -> `fwd` -> B -> `bwd` -> W.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from recsys_pipe.engine import BATCH_CPU, STEP_RESULT, SchedulablePipeline, Schedule, Task, TaskContext

__all__ = [
    "LOOKAHEAD_DIR",
    "SCHEDULES",
    "LookaheadSchedule",
    "StagePlan",
    "firing_order",
    "is_lookahead_file",
    "load_lookahead_schedule",
    "stage_plan",
    "stage_schedule",
    "stage_tasks",
]

#: the shipped lookahead schedules, one YAML file each
LOOKAHEAD_DIR = Path(__file__).resolve().parent / "lookahead"
#: the schedules a single stage per rank runs as an engine plan: the files of `LOOKAHEAD_DIR`
SCHEDULES = tuple(sorted(path.stem for path in LOOKAHEAD_DIR.glob("*.yaml")))

Lookahead = StrictInt | StrictStr

# A lookahead is a small integer expression. Python's `ast` parses it and the walk below allows
# only integers, the names p, r, m and + - * // (no library evaluates such expressions safely
# without also allowing calls and attributes; sympy would be a heavy dependency for four operators).
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def _evaluate(value: int | str, names: dict[str, int]) -> int:
    """`value` (an int, or an expression in `names`) as an int; ValueError if it is not one."""
    if isinstance(value, int):
        return value

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"{value!r}: a lookahead is an integer expression of p, r, m with + - * // and ()")

    try:
        tree = ast.parse(value, mode="eval")
    except SyntaxError:
        raise ValueError(f"{value!r}: not an expression") from None
    return walk(tree)


class LookaheadSchedule(BaseModel):
    """A single-stage-per-rank schedule as the YAML file declares it: how many microbatches each
    task runs ahead, as integer expressions in p (stages), r (this stage), m (microbatches)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: the forward F (and the activations' receive and send)
    forward: Lookahead
    #: the backward: B (input gradient) when `weight` is set, else the full backward BW
    backward: Lookahead
    #: the weight gradient W, or null for one full backward
    weight: Lookahead | None = None

    def lookaheads(self, p: int, r: int, m: int) -> tuple[int, int, int | None]:
        """(forward, backward, weight) of stage `r` of `p` over `m` microbatches."""
        names = {"p": p, "r": r, "m": m}
        values = [_evaluate(self.forward, names), _evaluate(self.backward, names)]
        weight = None if self.weight is None else _evaluate(self.weight, names)
        for key, value in zip(("forward", "backward", "weight"), [*values, weight]):
            if value is not None and value < 0:
                raise ValueError(f"{key}: {value} for stage {r} of {p} with {m} microbatches; lookaheads are >= 0")
        return values[0], values[1], weight


def is_lookahead_file(schedule: str) -> bool:
    """Whether `parallel.pp.schedule` names a YAML file of the user's (not a shipped name)."""
    return schedule.endswith((".yaml", ".yml"))


def load_lookahead_schedule(schedule: str) -> LookaheadSchedule:
    """The schedule a shipped name or a YAML file declares; ValueError (one line, the file and
    the key) when it cannot be read or does not fit."""
    path = Path(schedule) if is_lookahead_file(schedule) else LOOKAHEAD_DIR / f"{schedule}.yaml"
    if not is_lookahead_file(schedule) and schedule not in SCHEDULES:
        raise ValueError(f"unknown single-stage pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    try:
        data = yaml.safe_load(path.read_text())
        return LookaheadSchedule.model_validate(data)
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML: {' '.join(str(exc).split())}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"])) or "the file"
        raise ValueError(f"{path}: {where}: {first['msg']}") from None


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
    """The plan of stage `stage` of `num_stages` for `schedule` (a shipped name or a YAML file,
    `load_lookahead_schedule`) over `microbatches`."""
    p, r, m = num_stages, stage, microbatches
    if p < 1 or not 0 <= r < p or m < 1:
        raise ValueError(f"need 0 <= stage < num_stages and microbatches >= 1, got stage={r}, p={p}, m={m}")
    lookaheads = load_lookahead_schedule(schedule).lookaheads(p, r, m)
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
