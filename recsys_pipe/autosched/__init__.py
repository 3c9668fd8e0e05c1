"""Schedule tooling on top of the engine: cost models, the plan simulator, lookahead assignment
and plan tuning, and pipeline-parallel schedules. Imports only the engine, the standard library,
numpy and matplotlib."""

from recsys_pipe.autosched.costs import CostModel, TaskCost
from recsys_pipe.autosched.simulator import CriticalStep, SimResult, SimSpan, resolve_threads, simulate

__all__ = ["CostModel", "CriticalStep", "SimResult", "SimSpan", "TaskCost", "resolve_threads", "simulate"]
