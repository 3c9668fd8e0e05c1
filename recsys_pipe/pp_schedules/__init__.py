"""Pipeline-parallel schedules as data: per-rank action lists (`Action`, `PipelineSchedule`,
torch's string and CSV forms), the generators of the named schedules (`build`) and what makes a
schedule runnable (`validate`, `schedule_graph`).

A leaf: it imports only the standard library, so the runtime (`recsys_pipe.pp`) and the analysis
(`recsys_pipe.autosched`) both build on it without depending on each other.
"""

from recsys_pipe.pp_schedules.actions import Action, PipelineSchedule, from_csv, to_csv
from recsys_pipe.pp_schedules.check import (
    PipelineScheduleError,
    ScheduleGraph,
    Transfer,
    Wait,
    as_schedule,
    schedule_graph,
    validate,
)
from recsys_pipe.pp_schedules.generators import SCHEDULES, build

__all__ = [
    "SCHEDULES",
    "Action",
    "PipelineSchedule",
    "PipelineScheduleError",
    "ScheduleGraph",
    "Transfer",
    "Wait",
    "as_schedule",
    "build",
    "from_csv",
    "schedule_graph",
    "to_csv",
    "validate",
]
