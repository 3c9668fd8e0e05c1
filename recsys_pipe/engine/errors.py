"""Errors raised by the engine.

Validation errors carry structured `Problem`s (task, field, index) so that layers above the
engine (the Hydra plan compiler) can point at the exact config path without parsing text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a task graph: what, and where (task, field, item index)."""

    message: str
    task: str | None = None
    field: str | None = None
    index: int | None = None

    def where(self) -> str:
        """Where the problem is, as printed: `task graph`, or `task 'x' field reads[1]`."""
        if self.task is None:
            return "task graph"
        loc = f"task '{self.task}'"
        if self.field is not None:
            loc += f" field {self.field}" + (f"[{self.index}]" if self.index is not None else "")
        return loc

    def __str__(self) -> str:
        return f"{self.where()}: {self.message}"


class TaskGraphValidationError(ValueError):
    """A task graph (or one task) breaks a declaration rule. `problems` lists every violation."""

    def __init__(self, problems: Problem | Iterable[Problem]):
        self.problems: list[Problem] = [problems] if isinstance(problems, Problem) else list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class DependencyCycleError(TaskGraphValidationError):
    """The in-iteration dependency graph has a cycle; the message names it."""


class TaskFailedError(RuntimeError):
    """A task raised while running; names the task, the batch and the internal iteration.

    The original exception is chained as `__cause__`.
    """

    def __init__(self, task: str, batch_index: int, iteration: int):
        self.task = task
        self.batch_index = batch_index
        self.iteration = iteration
        super().__init__(f"task '{task}' failed on batch {batch_index} (internal iteration {iteration})")


class PlanRunnerBrokenError(RuntimeError):
    """Raised by `progress()` after an earlier failure: a half-done iteration cannot resume."""
