"""Pydantic models of the plan (the `pipeline:` node) and `Section`, the base of every config.

Why pydantic: the user's whole interface is YAML plus command-line overrides, so every value is
checked, with a path, before anything is built. Every section forbids unknown keys, so a typo
(`lookahed: 3`) is an error instead of a silently ignored setting. Types are strict where a
silent coercion would hide a mistake (`lookahead: 1.5`, `nccl: "yes"`).

Each component owns its config next to its code (data sources in `recsys_pipe.data`, models in
`recsys_pipe.models`, optimizers and the trainer in `recsys_pipe.train`); they all derive from
`Section`. These plan models only describe shapes and value ranges; cross-references (unknown
task or stream names) and the engine's task-graph rules are checked by `recsys_pipe.config.compile`,
which reports them with the same `path: message` format.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)

from recsys_pipe.config.resolve import FnResolveError, check_import_path
from recsys_pipe.config.task_registry import is_task_name

__all__ = [
    "Slot",
    "CrossIterDep",
    "Section",
    "TaskConfig",
    "ThreadMapConfig",
    "PlanConfig",
    "TASK_FIELDS",
]


class Section(BaseModel):
    """Base of every config section: unknown keys are errors; values are validated on
    assignment too. Field descriptions are what `--help` shows for each key."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _slot(value: Any) -> Any:
    """A slot is `name` (the task's own batch) or `[name, batch_offset]`."""
    if isinstance(value, str):
        if not value:
            raise ValueError("a slot name must be non-empty")
        return value
    if isinstance(value, (list, tuple)) and len(value) == 2:
        name, offset = value
        if isinstance(name, str) and name and isinstance(offset, int) and not isinstance(offset, bool):
            return (name, offset)
    raise ValueError(f"a slot is a name or [name, batch_offset], got {value!r}")


def _cross_iter(value: Any) -> Any:
    """A cross-iteration dependency is `name` (meaning [name, -1]) or `[name, -N]`."""
    if isinstance(value, str):
        if not value:
            raise ValueError("expected a task name")
        return value
    if isinstance(value, (list, tuple)) and len(value) == 2:
        name, offset = value
        if isinstance(name, str) and name and isinstance(offset, int) and not isinstance(offset, bool):
            return (name, offset)
    raise ValueError(f"expected a task name or [name, -N], got {value!r}")


#: `reads`/`writes` item: bare name (own batch) or (name, batch_offset).
Slot = Annotated[str | tuple[str, int], BeforeValidator(_slot)]
#: `cross_iter_depends_on` item: bare name (= (name, -1)) or (name, -N).
CrossIterDep = Annotated[str | tuple[str, int], BeforeValidator(_cross_iter)]
TaskName = Annotated[StrictStr, Field(min_length=1)]


def _task_fn(fn: str) -> str:
    """A task's `fn` as plans spell it: a registered name (`h2d`) or `pkg.module:function`; any
    other spelling (the dotted path of earlier plans) is refused with the colon form to write."""
    if not is_task_name(fn):
        try:
            check_import_path(fn)
        except FnResolveError as exc:
            raise ValueError(f"{exc}, or a registered task's name") from None
    return fn


class TaskConfig(Section):
    """One task of the plan. Its name is its key in `pipeline.tasks`."""

    fn: Annotated[StrictStr, AfterValidator(_task_fn)] = Field(
        description="the task function `fn(ctx) -> None`: a registered task (h2d, forward, ...) or the import "
        "path of your own, pkg.module:function"
    )
    stream: StrictStr = Field("default", min_length=1, description="stream name; must be listed in pipeline.streams")
    lookahead: StrictInt = Field(0, ge=0, description="how many batches ahead of the trained batch this task runs")
    reads: list[Slot] = Field(default_factory=list, description="slots consumed: name or [name, batch_offset]")
    writes: list[Slot] = Field(default_factory=list, description="slots produced: name or [name, batch_offset]")
    depends_on: list[TaskName] = Field(default_factory=list, description="same-batch dependencies")
    cross_iter_depends_on: list[CrossIterDep] = Field(
        default_factory=list, description="name (= [name, -1]) or [name, -N]: wait for that task on batch K-N"
    )
    same_progress_sync: list[TaskName] = Field(
        default_factory=list, description="wait for these tasks' work in the same iteration, whatever batch"
    )
    nccl: StrictBool = Field(False, description="issues collectives: takes a ticket of the ordered NCCL lock")
    thread: StrictStr | None = Field(None, min_length=1, description="CPU thread id; overrides pipeline.thread_map")
    nvtx_tag: StrictStr | None = Field(None, description="NVTX range label (default: the task name)")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="the task function's own settings, e.g. h2d's inplace_copy (checked by a registered task)",
    )


#: Field names of a task, in declaration order (used for suggestions and the Hydra skeleton).
TASK_FIELDS: tuple[str, ...] = tuple(TaskConfig.model_fields)


class ThreadMapConfig(Section):
    """Which CPU thread submits each task (threaded executor only).

    strategy:
      by_stream  thread id = the task's stream name
      per_task   one thread per task
      single     every task on thread `thread`
      dict       `map` {task: thread}, `default` for tasks not listed
    A task's own `thread:` wins over the map.
    """

    name: StrictStr | None = Field(None, description="label shown by recsys-plan")
    strategy: Literal["by_stream", "per_task", "single", "dict"] = Field(
        "by_stream", description="by_stream | per_task | single | dict (map + default)"
    )
    map: dict[str, StrictStr] = Field(default_factory=dict, description="strategy=dict: {task: thread}")
    default: StrictStr = Field("default", min_length=1, description="strategy=dict: thread of unlisted tasks")
    thread: StrictStr = Field("main", min_length=1, description="strategy=single: the one thread id")

    @model_validator(mode="after")
    def _map_only_with_dict(self) -> ThreadMapConfig:
        if self.map and self.strategy != "dict":
            raise ValueError(f"'map' is only used with strategy 'dict' (strategy is '{self.strategy}')")
        return self


class PlanConfig(Section):
    """The plan: the tasks of one training iteration and how they are executed."""

    name: StrictStr | None = Field(None, description="plan name shown by recsys-plan")
    description: StrictStr = Field("", description="one line shown by recsys-plan")
    executor: Literal["sequential", "threaded"] = Field(
        "sequential", description="sequential: one thread, topological order; threaded: threads from thread_map"
    )
    streams: list[Annotated[StrictStr, Field(min_length=1)]] = Field(
        default_factory=lambda: ["default"], description="stream names; 'default' is always available"
    )
    thread_map: ThreadMapConfig = Field(default_factory=ThreadMapConfig, description="CPU thread of each task")
    torchrec_context: Literal["base", "prefetch", "semi_sync", "fused"] = Field(
        "base",
        description="torchrec pipeline context and pipelined forward per batch: prefetch for plans that prefetch "
        "embeddings; semi_sync / fused for plans whose start_embedding_lookup task starts the lookup (semi_sync: "
        "embeddings detached, their own backward task)",
    )
    tasks: dict[str, TaskConfig] = Field(description="task name -> task; YAML order breaks topological ties")

    @model_validator(mode="after")
    def _non_empty(self) -> PlanConfig:
        if not self.tasks:
            raise ValueError("a plan needs at least one task")
        return self
