"""`parallel.pp.schedule` resolved into what each rank runs.

A single-stage-per-rank schedule (gpipe, 1f1b, zb_h1, zb_h2, or a YAML file declaring the
lookaheads) runs as an engine plan of lookaheads (`recsys_pipe.pp.plan`); the others run as a
static per-rank action order (`recsys_pipe.pp.actions`): interleaved 1F1B and ZBV take their orders from
torch.distributed.pipelining's own schedule classes (so they are the orders torch runs),
DualPipeV from `recsys_pipe.pp_schedules.generators.build("dualpipev")` (the same order as
torch's class, tested), and a
CSV in torch's format is read with `recsys_pipe.pp_schedules.actions.from_csv` and checked with
`recsys_pipe.pp_schedules.validate` (routes, B after F, no deadlock). Where each
stage lives is read off the action lists. Every misfit is a ConfigError naming its key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.pp.plan import SCHEDULES as PLAN_SCHEDULES
from recsys_pipe.pp.plan import is_lookahead_file, stage_plan
from recsys_pipe.pp_schedules import Action, PipelineSchedule, PipelineScheduleError, build, from_csv, validate

__all__ = [
    "ACTION_SCHEDULES",
    "NAMED_SCHEDULES",
    "ResolvedSchedule",
    "default_stages_per_rank",
    "resolve_schedule",
]

#: schedule name -> torch.distributed.pipelining's class name (whose action order is used), or
#: None for our own generator (`recsys_pipe.pp_schedules.generators.build`)
ACTION_SCHEDULES = {"interleaved_1f1b": "Interleaved1F1B", "zbv": "ZBVZeroBubble", "dualpipev": None}
NAMED_SCHEDULES = (*PLAN_SCHEDULES, *ACTION_SCHEDULES)
_V_SCHEDULES = ("zbv", "dualpipev")
KEY = "parallel.pp"


@dataclass(frozen=True)
class ResolvedSchedule:
    """What every rank runs: `actions` (per-rank action lists) or, when None, the lookahead
    plan of `name` with one stage per rank; `ranks_of_stages[s]` is the rank of stage s."""

    name: str
    microbatches: int
    ranks_of_stages: tuple[int, ...]
    actions: PipelineSchedule | None

    @property
    def num_stages(self) -> int:
        """Stages over all ranks (more than ranks for interleaved and V schedules)."""
        return len(self.ranks_of_stages)

    def local_stages(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` holds, in stage order."""
        return tuple(s for s, r in enumerate(self.ranks_of_stages) if r == rank)

    def compute_orders(self) -> PipelineSchedule:
        """Every rank's compute steps in the order it runs them: the action lists, or for a
        lookahead plan the order the engine fires it in (`firing_order`); for `simulate`."""
        if self.actions is not None:
            return PipelineSchedule.of([[c for a in row for c in a.computes] for row in self.actions.ranks], self.name)
        from recsys_pipe.pp.plan import firing_order

        rows = []
        for rank in range(len(self.ranks_of_stages)):
            plan = stage_plan(self.name, len(self.ranks_of_stages), rank, self.microbatches)
            rows.append([Action(k, rank, mb) for k, mb in firing_order(plan) if k in ("F", "B", "W", "BW")])
        return PipelineSchedule.of(rows, self.name)


def is_csv(schedule: str) -> bool:
    return schedule.endswith(".csv")


def default_stages_per_rank(schedule: str) -> int | None:
    """1 for the lookahead schedules (a YAML file too), 2 for the others; None for a CSV (read
    off the file)."""
    if is_csv(schedule):
        return None
    return 1 if schedule in PLAN_SCHEDULES or is_lookahead_file(schedule) else 2


def _problem(field: str, message: str) -> ConfigError:
    return ConfigError(ConfigProblem(f"{KEY}.{field}", message))


def resolve_schedule(schedule: str, size: int, microbatches: int, stages_per_rank: int | None) -> ResolvedSchedule:
    """The schedule `parallel.pp.schedule` names, for `size` ranks and `microbatches`."""
    if is_csv(schedule):
        return _from_csv(schedule, size, microbatches, stages_per_rank)
    if is_lookahead_file(schedule):
        return _from_lookahead_file(schedule, size, microbatches, stages_per_rank)
    if schedule not in NAMED_SCHEDULES:
        raise _problem(
            "schedule",
            f"unknown schedule {schedule!r}: one of {', '.join(NAMED_SCHEDULES)}, or a .yaml or .csv file",
        )
    per_rank = default_stages_per_rank(schedule) if stages_per_rank is None else stages_per_rank
    if schedule in PLAN_SCHEDULES:
        if per_rank != 1:
            raise _problem("stages_per_rank", f"{schedule} runs one stage per rank, got {per_rank}")
        return ResolvedSchedule(schedule, microbatches, tuple(range(size)), None)
    if schedule in _V_SCHEDULES and per_rank != 2:
        raise _problem("stages_per_rank", f"{schedule} folds the stages into a V: 2 per rank, got {per_rank}")
    if per_rank < 2:
        raise _problem("stages_per_rank", f"{schedule} interleaves stages: at least 2 per rank, got {per_rank}")
    # torch's classes generate their order from mock stages; their checks (microbatches versus
    # stages) and our generators' raise ValueError, reported here against the microbatches.
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    torch_class = ACTION_SCHEDULES[schedule]
    try:
        if torch_class is None:
            actions = build(schedule, size, microbatches)
        else:
            actions = PipelineSchedule.of(get_schedule_ops(torch_class, size, microbatches, per_rank), schedule)
    except ValueError as exc:
        raise _problem("microbatches", f"{schedule} on {size} rank(s) x {per_rank} stages: {exc}") from None
    return ResolvedSchedule(schedule, microbatches, _ranks_of_stages(actions, schedule), actions)


def _from_lookahead_file(path: str, size: int, microbatches: int, stages_per_rank: int | None) -> ResolvedSchedule:
    """A YAML file of lookaheads: one stage per rank; every rank's plan must evaluate and the
    ranks' orders fit together (routes, B after F, no deadlock: `validate`)."""
    if stages_per_rank not in (None, 1):
        raise _problem("stages_per_rank", f"{path} declares lookaheads: one stage per rank, got {stages_per_rank}")
    try:
        for rank in range(size):
            stage_plan(path, size, rank, microbatches)
        resolved = ResolvedSchedule(path, microbatches, tuple(range(size)), None)
        validate(resolved.compute_orders())
    except (ValueError, PipelineScheduleError) as exc:
        reason = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # one line
        raise _problem("schedule", reason if reason.startswith(path) else f"{path}: {reason}") from None
    return resolved


def _from_csv(path: str, size: int, microbatches: int, stages_per_rank: int | None) -> ResolvedSchedule:
    if not Path(path).is_file():
        raise _problem("schedule", f"no such file: {path}")
    try:
        actions = validate(from_csv(path, Path(path).stem))
    except (ValueError, PipelineScheduleError) as exc:
        reason = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # one line
        raise _problem("schedule", f"{path}: {reason}") from None
    if actions.num_ranks != size:
        raise _problem("schedule", f"{path} has {actions.num_ranks} rank row(s), parallel.pp.size={size}")
    if actions.num_microbatches != microbatches:
        raise _problem(
            "schedule",
            f"{path} runs {actions.num_microbatches} microbatch(es), parallel.pp.microbatches={microbatches}",
        )
    if stages_per_rank is not None and actions.num_stages != size * stages_per_rank:
        raise _problem(
            "stages_per_rank",
            f"{path} has {actions.num_stages} stages, not {stages_per_rank} on each of {size} rank(s)",
        )
    return ResolvedSchedule(Path(path).stem, microbatches, _ranks_of_stages(actions, path), actions)


def _ranks_of_stages(actions: PipelineSchedule, source: str) -> tuple[int, ...]:
    ranks: dict[int, set[int]] = {}
    for rank, row in enumerate(actions.ranks):
        for action in row:
            for part in action.computes:
                ranks.setdefault(part.stage, set()).add(rank)
    stages = sorted(ranks)
    if stages != list(range(len(stages))) or any(len(r) != 1 for r in ranks.values()):
        raise _problem("schedule", f"{source}: every stage 0..n-1 must run on exactly one rank, got {ranks}")
    return tuple(next(iter(ranks[s])) for s in stages)
