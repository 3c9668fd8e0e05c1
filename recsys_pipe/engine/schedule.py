"""Schedule and Stage: the frozen declaration of one training iteration."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from recsys_pipe.engine.task import Task


@dataclass(frozen=True)
class Stage:
    """Tasks that run in one executor call; stages run one after another within an iteration."""

    tasks: tuple[Task, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))


@dataclass(frozen=True)
class Schedule:
    """Stages plus the names of the streams the tasks may use."""

    stages: tuple[Stage, ...]
    stream_slots: tuple[str, ...] = ("default",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "stream_slots", tuple(self.stream_slots))

    @classmethod
    def single_stage(cls, tasks: Iterable[Task], stream_slots: Iterable[str] | None = None) -> Schedule:
        """A one-stage schedule; streams default to those the tasks use, `default` first."""
        tasks = tuple(tasks)
        if stream_slots is None:
            stream_slots = dict.fromkeys(["default", *(t.stream for t in tasks)])
        return cls(stages=(Stage(tasks),), stream_slots=tuple(stream_slots))

    @property
    def tasks(self) -> tuple[Task, ...]:
        """Every task of every stage, in stage order."""
        return tuple(t for stage in self.stages for t in stage.tasks)

    @property
    def max_lookahead(self) -> int:
        """The largest lookahead of any task (0 for an empty schedule)."""
        return max((t.lookahead for t in self.tasks), default=0)

    @property
    def in_flight_batches(self) -> int:
        """How many batches are in flight, `max_lookahead + 1`."""
        return self.max_lookahead + 1
