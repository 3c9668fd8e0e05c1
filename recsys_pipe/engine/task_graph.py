"""TaskGraph and TaskGroup: the frozen declaration of one training iteration.

A `TaskGraph` is the tasks of one iteration and the streams they may use; its edges are what the
tasks declare (`reads`, `writes`, `depends_on`, ...), and `compile_dependencies` resolves them
into a `DependencyGraph`, the form a `PlanRunner` runs. A `TaskGroup` is one executor call's
tasks: a graph's groups run one after another within an iteration (plans have one group).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from recsys_pipe.engine.task import Task


@dataclass(frozen=True)
class TaskGroup:
    """Tasks that run in one executor call; groups run one after another within an iteration."""

    tasks: tuple[Task, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))


@dataclass(frozen=True)
class TaskGraph:
    """Task groups plus the names of the streams the tasks may use."""

    groups: tuple[TaskGroup, ...]
    stream_slots: tuple[str, ...] = ("default",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "stream_slots", tuple(self.stream_slots))

    @classmethod
    def single_group(cls, tasks: Iterable[Task], stream_slots: Iterable[str] | None = None) -> TaskGraph:
        """A one-group task graph; streams default to those the tasks use, `default` first."""
        tasks = tuple(tasks)
        if stream_slots is None:
            stream_slots = dict.fromkeys(["default", *(t.stream for t in tasks)])
        return cls(groups=(TaskGroup(tasks),), stream_slots=tuple(stream_slots))

    @property
    def tasks(self) -> tuple[Task, ...]:
        """Every task of every group, in group order."""
        return tuple(t for group in self.groups for t in group.tasks)

    @property
    def max_lookahead(self) -> int:
        """The largest lookahead of any task (0 for an empty task_graph)."""
        return max((t.lookahead for t in self.tasks), default=0)

    @property
    def in_flight_batches(self) -> int:
        """How many batches are in flight, `max_lookahead + 1`."""
        return self.max_lookahead + 1
