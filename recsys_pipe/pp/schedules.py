"""`parallel.pp.schedule` resolved into what each rank runs.

Every schedule becomes per-rank action lists, which one runner runs
(`recsys_pipe.pp.actions.ActionOrderRunner`): a single-stage-per-rank schedule declared as
lookaheads (gpipe, 1f1b, zb_h1, zb_h2, or a YAML file of the user's) is compiled from them
(`recsys_pipe.pp_schedules.lookahead`); interleaved 1F1B and ZBV take their orders from
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
from recsys_pipe.pp_schedules import PipelineSchedule, PipelineScheduleError, build, from_csv, validate
from recsys_pipe.pp_schedules.lookahead import LOOKAHEAD_SCHEDULES, is_lookahead_file, lookahead_schedule

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
NAMED_SCHEDULES = (*LOOKAHEAD_SCHEDULES, *ACTION_SCHEDULES)
_V_SCHEDULES = ("zbv", "dualpipev")
KEY = "parallel.pp"


@dataclass(frozen=True)
class ResolvedSchedule:
    """What every rank runs: `actions`, per-rank action lists; `ranks_of_stages[s]` is the rank
    of stage s. `lookaheads`: the schedule is declared as lookaheads (`name`: a shipped name or
    the YAML file), one stage per rank, and `actions` are compiled from them."""

    name: str
    microbatches: int
    ranks_of_stages: tuple[int, ...]
    actions: PipelineSchedule
    lookaheads: bool = False

    @property
    def num_stages(self) -> int:
        """Stages over all ranks (more than ranks for interleaved and V schedules)."""
        return len(self.ranks_of_stages)

    def local_stages(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` holds, in stage order."""
        return tuple(s for s, r in enumerate(self.ranks_of_stages) if r == rank)

    def compute_orders(self) -> PipelineSchedule:
        """Every rank's compute steps in the order it runs them (for `simulate`)."""
        return PipelineSchedule.of([[c for a in row for c in a.computes] for row in self.actions.ranks], self.name)


def is_csv(schedule: str) -> bool:
    return schedule.endswith(".csv")


def default_stages_per_rank(schedule: str) -> int | None:
    """1 for the lookahead schedules (a YAML file too), 2 for the others; None for a CSV (read
    off the file)."""
    if is_csv(schedule):
        return None
    return 1 if schedule in LOOKAHEAD_SCHEDULES or is_lookahead_file(schedule) else 2


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
    if schedule in LOOKAHEAD_SCHEDULES:
        if per_rank != 1:
            raise _problem("stages_per_rank", f"{schedule} runs one stage per rank, got {per_rank}")
        actions = lookahead_schedule(schedule, size, microbatches)
        return ResolvedSchedule(schedule, microbatches, tuple(range(size)), actions, lookaheads=True)
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
        actions = validate(lookahead_schedule(path, size, microbatches))
        resolved = ResolvedSchedule(path, microbatches, tuple(range(size)), actions, lookaheads=True)
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
