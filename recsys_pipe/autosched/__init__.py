"""Schedule tooling on top of the engine: cost models, the plan simulator, lookahead assignment
and plan tuning, plan YAML output, and pipeline-parallel schedules
(`recsys_pipe.autosched.pipeline_parallel`). Imports only the engine, the standard library,
numpy and matplotlib."""

from recsys_pipe.autosched.costs import CostModel, TaskCost
from recsys_pipe.autosched.plan_yaml import plan_yaml
from recsys_pipe.autosched.simulator import CriticalStep, SimResult, SimSpan, resolve_threads, simulate
from recsys_pipe.autosched.tune import FROZEN_TASKS, TaskChange, TuneResult, auto_assign_lookaheads, tune

__all__ = [
    "FROZEN_TASKS",
    "CostModel",
    "CriticalStep",
    "SimResult",
    "SimSpan",
    "TaskChange",
    "TaskCost",
    "TuneResult",
    "auto_assign_lookaheads",
    "plan_yaml",
    "resolve_threads",
    "simulate",
    "tune",
]
