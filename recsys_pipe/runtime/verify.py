"""Verification mode: a task that issues a collective without `nccl: true` is a plan error.

Why: the threaded executor orders only the tasks declared `nccl: true` identically on every rank.
A collective issued from an undeclared task can interleave differently on two ranks, and gloo
then aborts the process ("collective mismatch", SIGABRT) or NCCL hangs, far from the cause. In
verification mode each task that is not declared `nccl` runs under a torch dispatch mode that
sees every operator it calls; `torch.distributed`'s collectives are dispatcher operators of the
`c10d` namespace, so the first one is caught *before* it is issued (no rank is left waiting) and
fails the task with a `ConfigError` naming `pipeline.tasks.<task>.nccl`. Every rank runs the same
plan, so every rank stops at the same task with the same message, and `recsys-train` exits 2.

The mode is installed through the engine's `TaskObserver` hooks, which run on the thread that
runs the task, around the task; dispatch modes are per thread, so only that task is watched.
`trainer.verify_collectives`: `startup` (default) watches the first iterations of each plan runner,
enough for every task to run in the prefill and the steady state, and then detaches (no cost
afterwards); `always` watches every iteration (tests); `off`.
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.engine import PlanRunner, Task, TaskScopes

__all__ = ["CollectiveGuard", "UndeclaredCollectiveError"]


class UndeclaredCollectiveError(ConfigError):
    """A task not declared `nccl: true` issued a collective (a plan error, at its `nccl` field)."""

    def __init__(self, task: str, op: str):
        self.task = task
        self.op = op
        super().__init__(
            ConfigProblem(
                f"pipeline.tasks.{task}.nccl",
                f"task '{task}' issues the collective {op} but is not declared nccl: true; declare it so that "
                "collectives are issued in the same order on every rank",
            )
        )


class _RefuseCollectives(TorchDispatchMode):
    """Dispatch mode of one task: raises on the first `c10d` operator, passes everything else."""

    def __init__(self, task: str):
        super().__init__()
        self.task = task

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            raise UndeclaredCollectiveError(self.task, f"{func.namespace}.{func.__name__.split('.')[0]}")
        return func(*args, **(kwargs or {}))


class CollectiveGuard(TaskScopes):
    """The verification mode as an observer of `runner` (installs itself).

    Args:
        runner: the plan runner to watch.
        iterations: watch this many internal iterations, then detach (None: always).
    """

    def __init__(self, runner: PlanRunner, iterations: int | None = None):
        super().__init__()
        self.runner = runner
        self.remaining = iterations
        runner.observer = self

    def task_scope(self, task: Task, batch_index: int) -> _RefuseCollectives | None:
        return None if task.nccl else _RefuseCollectives(task.name)

    def iteration_finished(self, iteration: int, failed: bool) -> None:
        if self.remaining is None:
            return
        self.remaining -= 1
        if self.remaining <= 0 and self.runner.observer is self:
            self.runner.observer = None  # verified: no cost from here on
