"""The executor protocol and the sequential executor."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from recsys_pipe.engine.deps import DependencyGraph
from recsys_pipe.engine.task import Task

#: Runs one task for the current iteration: event waits, stream, NVTX range, observer hooks,
#: completion event. Safe to call from any thread.
RunTask = Callable[[Task], None]


class Executor(Protocol):
    """Decides on which CPU thread, and in what interleaving, an iteration's tasks run.

    `tasks` are the tasks that fire this iteration, in topological order; the executor must run
    each exactly once through `run`, respecting that order wherever a dependency exists, and
    return only when all have finished (or raise the first failure after all have stopped).
    """

    def execute(self, tasks: Sequence[Task], run: RunTask, graph: DependencyGraph) -> None:
        """Run one iteration's firing tasks.

        Args:
            tasks: the tasks that fire this iteration, in topological order.
            run: runs one task (its stream context, waits, events and observer hooks included).
            graph: the compiled task graph, for the edges between the tasks."""

    def shutdown(self) -> None:
        """Release the executor's threads; it runs nothing afterwards."""


class SequentialExecutor:
    """One thread, topological order."""

    def execute(self, tasks: Sequence[Task], run: RunTask, graph: DependencyGraph) -> None:
        """Run `tasks` one after another on the calling thread, in the given (topological) order."""
        for task in tasks:
            run(task)

    def shutdown(self) -> None:
        """Nothing to release: this executor owns no threads."""
        pass

    def __repr__(self) -> str:
        return "SequentialExecutor()"
