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

    def execute(self, tasks: Sequence[Task], run: RunTask, graph: DependencyGraph) -> None: ...

    def shutdown(self) -> None: ...


class SequentialExecutor:
    """One thread, topological order."""

    def execute(self, tasks: Sequence[Task], run: RunTask, graph: DependencyGraph) -> None:
        for task in tasks:
            run(task)

    def shutdown(self) -> None:
        pass

    def __repr__(self) -> str:
        return "SequentialExecutor()"
