"""What a running task sees."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

from recsys_pipe.engine.slots import BatchRing, SlotStore
from recsys_pipe.engine.streams import StreamPool

if TYPE_CHECKING:
    from recsys_pipe.engine.task import Task

__all__ = ["StateT", "TaskContext"]

#: The type of the plan runner's shared state (`PlanRunner(..., state=...)`).
StateT = TypeVar("StateT")


class TaskContext(Generic[StateT]):
    """The view of one task invocation: its batch's store, the ring, the streams, and the
    plan runner's shared `state` (model, optimizer, process group: whatever the caller passed).

    Generic over the state's type, so a task annotated `ctx: TaskContext[TrainState]` sees a
    typed `ctx.state` (the engine never looks inside it). Unparametrised, `state` is `Any`.

    One object per invocation rather than a thread-local: tasks on different worker threads
    each hold their own view with no shared mutable cursor.
    """

    __slots__ = ("task", "batch_index", "iter_count", "ring", "stream_pool", "state")

    def __init__(
        self,
        task: Task,
        batch_index: int | None,
        iter_count: int,
        ring: BatchRing,
        stream_pool: StreamPool,
        state: StateT,
    ):
        self.task = task
        self.batch_index = batch_index
        self.iter_count = iter_count
        self.ring = ring
        self.stream_pool = stream_pool
        self.state: StateT = state

    @property
    def slots(self) -> SlotStore:
        """The store of the batch this task is processing: `ring.at(task.lookahead)`."""
        return self.ring.at(self.task.lookahead)

    @property
    def stream(self) -> Any:
        """The stream this task runs on."""
        return self.stream_pool.get(self.task.stream)

    def __repr__(self) -> str:
        return f"TaskContext(task={self.task.name!r}, batch={self.batch_index}, iter={self.iter_count})"
