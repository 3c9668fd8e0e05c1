"""Schedule tooling on top of the engine: cost models (and, built on them, profiling and
simulation). Imports only the engine, the standard library, numpy and matplotlib."""

from recsys_pipe.autosched.costs import CostModel, TaskCost

__all__ = ["CostModel", "TaskCost"]
