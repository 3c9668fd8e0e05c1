"""Single-stage-per-rank pipeline schedules declared as lookaheads, compiled to per-rank actions.

Per rank, a schedule is a plan whose "batches" are the microbatches of one optimizer step, in
the engine's terms (`recsys_pipe.engine`): a task with lookahead k processes the microbatch k
iterations ahead of the one finishing, so the prefill / steady state / drain are the schedule's
warm-up / steady state / cool-down. A schedule is declared in YAML: the lookaheads of F, B and W
as integer expressions in p (stages), r (this rank's stage) and m (microbatches), one file per
schedule in `recsys_pipe/pp_schedules/lookahead/` (or a file of the user's,
`parallel.pp.schedule=my.yaml`).
The shipped files (stage r of p; lookaheads in microbatches):

| schedule | F | B | W | |
|---|---|---|---|---|
| gpipe | m - 1 | 0 (full backward `BW`) | | every forward before any backward |
| 1f1b | p - 1 - r | 0 (`BW`) | | |
| zb_h1 | p - 1 | r | 0 | W held back r microbatches behind B |
| zb_h2 | 2(p - 1) | 2r | 0 | twice the warm-up, W held back 2r |

Relative to B, F runs `p-1-r` (zb_h1) or `2(p-1-r)` (zb_h2) microbatches ahead, as in the
Zero Bubble paper's handcrafted schedules; lookaheads are shifted so the smallest is 0.

`lookahead_order(plan)` compiles one rank's plan into the order the engine would fire it in:
iteration t (0 .. m-1 + the deepest lookahead L) runs F, then B (or BW), then W, each on
microbatch t - L + its lookahead when that is one of the step's m. Every schedule runs as such a
per-rank action order (`recsys_pipe.pp.actions.ActionOrderRunner`); `task_lookaheads(plan)` lists
the plan's tasks as `recsys-plan` prints them, the transfers beside the compute: `recv_F` /
`send_F` at F's lookahead, `recv_B` / `send_B` at B's.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from recsys_pipe.pp_schedules.actions import Action, PipelineSchedule

__all__ = [
    "LOOKAHEAD_DIR",
    "LOOKAHEAD_SCHEDULES",
    "LookaheadSchedule",
    "StagePlan",
    "is_lookahead_file",
    "load_lookahead_schedule",
    "lookahead_order",
    "lookahead_schedule",
    "stage_plan",
    "task_lookaheads",
]

#: the shipped lookahead schedules, one YAML file each
LOOKAHEAD_DIR = Path(__file__).resolve().parent / "lookahead"
#: the named schedules declared as lookaheads (one stage per rank): the files of `LOOKAHEAD_DIR`
LOOKAHEAD_SCHEDULES = tuple(sorted(path.stem for path in LOOKAHEAD_DIR.glob("*.yaml")))

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
    if not is_lookahead_file(schedule) and schedule not in LOOKAHEAD_SCHEDULES:
        known = ", ".join(LOOKAHEAD_SCHEDULES)
        raise ValueError(f"unknown single-stage pipeline schedule {schedule!r}; known: {known}")
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


def task_lookaheads(plan: StagePlan) -> list[tuple[str, int]]:
    """The rank's tasks with their lookaheads, in the order they run inside one iteration: the
    compute (F, B and W, or BW) and the transfers around it (none at the pipeline's ends)."""
    first, last = plan.stage == 0, plan.stage == plan.num_stages - 1
    f, b = plan.forward, plan.backward
    tasks = [] if first else [("recv_F", f)]
    tasks.append(("F", f))
    if not last:
        tasks += [("send_F", f), ("recv_B", b)]
    tasks.append(("B" if plan.split_backward else "BW", b))
    if not first:
        tasks.append(("send_B", b))
    if plan.split_backward:
        tasks.append(("W", plan.weight))
    return tasks


def lookahead_order(plan: StagePlan) -> tuple[Action, ...]:
    """The rank's compute actions in the order the engine fires `plan` over one step (see the
    module docstring): iteration by iteration, F then B (or BW) then W."""
    computes = [(kind, k) for kind, k in task_lookaheads(plan) if kind in ("F", "B", "BW", "W")]
    deepest = max(k for _, k in computes)
    order = []
    for t in range(plan.microbatches + deepest):
        for kind, k in computes:
            microbatch = t - deepest + k
            if 0 <= microbatch < plan.microbatches:
                order.append(Action(kind, plan.stage, microbatch))
    return tuple(order)


def lookahead_schedule(schedule: str, num_stages: int, microbatches: int) -> PipelineSchedule:
    """Every rank's compute order of a lookahead schedule (a shipped name or a YAML file), stage
    r on rank r; ValueError (one line) when a rank's plan does not evaluate."""
    ranks = [lookahead_order(stage_plan(schedule, num_stages, r, microbatches)) for r in range(num_stages)]
    return PipelineSchedule(tuple(ranks), Path(schedule).stem if is_lookahead_file(schedule) else schedule)
