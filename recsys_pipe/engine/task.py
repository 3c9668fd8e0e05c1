"""Task and DataSlot: the declarations a task graph is made of.

A Task is declared once (fields), then compiled with its task graph; its fields are normalised at
construction so every later step sees one canonical form: slots as `DataSlot`, cross-iteration
dependencies as `(name, -N)` pairs. Task-level mistakes raise `TaskGraphValidationError`
immediately, where the user wrote them, instead of surfacing later as an ordering bug.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from recsys_pipe.engine.errors import Problem, TaskGraphValidationError

if TYPE_CHECKING:
    from recsys_pipe.engine.context import TaskContext

#: Slot the engine fills with `next(batch_iter)` at the deepest lookahead.
BATCH_CPU = "batch_cpu"
#: Slot that `progress()` returns, read from the store of the batch being completed.
STEP_RESULT = "step_result"


@dataclass(frozen=True, order=True)
class DataSlot:
    """Opaque handle for a value in one batch's store: `ring.at(batch_offset)[name]`."""

    name: str
    batch_offset: int = 0

    def __str__(self) -> str:
        return f"{self.name}@{self.batch_offset}"


@dataclass(frozen=True)
class DeclaredIO:
    """An effect of a task outside its slots, made replayable for shortcuts.

    Args:
        capture: `capture(ctx) -> value`, called after the caching run with that run's context;
            snapshots the external state the task changed. Tensors in the value (at any depth of
            lists, tuples and dicts) are detached and cloned; other objects are kept as they are.
        restore: `restore(ctx, value)`, called on every replay, after the slots were replayed,
            with the replaying run's context and a fresh copy of the captured value (new
            tensors); writes the external state back so later tasks find it.
    """

    capture: Callable[[TaskContext], Any]
    restore: Callable[[TaskContext, Any], None]


DEPENDENCY_FIELDS = ("depends_on", "cross_iter_depends_on", "same_progress_sync")
TASK_FIELDS = (
    "name",
    "stream",
    "lookahead",
    "reads",
    "writes",
    *DEPENDENCY_FIELDS,
    "nccl",
    "nvtx_tag",
    "effects",
    "io",
    "options",
)


class Task:
    """One unit of work of a training iteration.

    Declare by subclassing (fields as class attributes, override `run`) or with
    `Task.from_fn(name, fn, **fields)`. Both forms go through the same normalisation:
    a bare string in `reads`/`writes` is the slot of the task's own batch
    (`DataSlot(name, lookahead)`), a bare name in `cross_iter_depends_on` means `(name, -1)`.
    """

    name: str = ""
    stream: str = "default"
    lookahead: int = 0
    reads: Any = ()
    writes: Any = ()
    depends_on: Any = ()
    cross_iter_depends_on: Any = ()
    same_progress_sync: Any = ()
    nccl: bool = False
    nvtx_tag: str | None = None
    #: what the task changes outside its slots (its declared reads and writes) that later tasks
    #: depend on: module state, shared objects, objects in its slots changed in place. None:
    #: nothing. Only shortcut replay reads it: a task with effects needs `io` to be replayed.
    effects: str | None = None
    #: `DeclaredIO(capture, restore)` entries that make the effects replayable (see
    #: `recsys_pipe.engine.shortcut`).
    io: Any = ()
    #: the task function's own settings (opaque to the engine; the plan compiler validates those
    #: of registered tasks against their options model). None: the function's defaults.
    options: Any = None

    def __init__(self, name: str | None = None, **fields: Any):
        unknown = sorted(set(fields) - set(TASK_FIELDS))
        if unknown:
            raise TypeError(f"Task got unknown field(s) {unknown}; valid fields: {list(TASK_FIELDS)}")
        raw = {f: fields[f] if f in fields else getattr(type(self), f) for f in TASK_FIELDS}
        if name is not None:
            raw["name"] = name
        self._configure(raw)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_fn(cls, name: str, fn: Callable[[TaskContext], Any], **fields: Any) -> Task:
        """A task whose `run(ctx)` calls `fn(ctx)`.

        `effects` and `io` default to what `declare_effects` attached to `fn`, so a function
        referenced from a plan file carries its own declaration.
        """
        if not callable(fn):
            raise TaskGraphValidationError(
                Problem(f"fn must be callable, got {type(fn).__name__}", task=name, field="fn")
            )
        return FnTask(name, fn, **fields)

    def replace(self, **changes: Any) -> Task:
        """A copy with some declared fields changed (bare slot names re-resolve at the new lookahead)."""
        unknown = sorted(set(changes) - set(TASK_FIELDS))
        if unknown:
            raise TypeError(f"Task.replace got unknown field(s) {unknown}")
        new = copy.copy(self)
        new._configure({**self._declared, **changes})
        return new

    def _configure(self, raw: Mapping[str, Any]) -> None:
        self._declared = dict(raw)
        problems: list[Problem] = []
        name = raw["name"]
        if not isinstance(name, str) or not name:
            raise TaskGraphValidationError(Problem(f"task name must be a non-empty string, got {name!r}", field="name"))
        self.name = name

        def bad(field: str, message: str, index: int | None = None) -> None:
            problems.append(Problem(message, task=name, field=field, index=index))

        stream = raw["stream"]
        if not isinstance(stream, str) or not stream:
            bad("stream", f"must be a non-empty stream name, got {stream!r}")
        self.stream = stream

        lookahead = raw["lookahead"]
        if not _is_int(lookahead) or lookahead < 0:
            bad("lookahead", f"must be an integer >= 0, got {lookahead!r}")
            lookahead = 0
        self.lookahead = lookahead

        self.reads = _normalise_slots(raw["reads"], lookahead, "reads", bad)
        self.writes = _normalise_slots(raw["writes"], lookahead, "writes", bad)
        self.depends_on = _normalise_names(raw["depends_on"], "depends_on", name, bad)
        self.same_progress_sync = _normalise_names(raw["same_progress_sync"], "same_progress_sync", name, bad)
        self.cross_iter_depends_on = _normalise_cross_iter(raw["cross_iter_depends_on"], name, bad)

        seen: dict[str, str] = {}
        for field in DEPENDENCY_FIELDS:
            for index, entry in enumerate(getattr(self, field)):
                dep = entry[0] if isinstance(entry, tuple) else entry
                if dep in seen and seen[dep] != field:
                    bad(
                        field,
                        f"'{dep}' is already listed in {seen[dep]}; a producer may appear "
                        "in only one of depends_on, cross_iter_depends_on, same_progress_sync",
                        index,
                    )
                seen.setdefault(dep, field)

        if not isinstance(raw["nccl"], bool):
            bad("nccl", f"must be true or false, got {raw['nccl']!r}")
        self.nccl = bool(raw["nccl"])
        tag = raw["nvtx_tag"]
        if tag is not None and not isinstance(tag, str):
            bad("nvtx_tag", f"must be a string, got {tag!r}")
        self.nvtx_tag = tag
        effects = raw["effects"]
        if effects is not None and (not isinstance(effects, str) or not effects):
            bad("effects", f"must be a non-empty description or None, got {effects!r}")
        self.effects = effects
        io = raw["io"]
        self.io = (io,) if isinstance(io, DeclaredIO) else _items(io)
        for index, entry in enumerate(self.io):
            if not isinstance(entry, DeclaredIO):
                bad("io", f"expected a DeclaredIO(capture, restore), got {entry!r}", index)
        self.options = raw["options"]
        if problems:
            raise TaskGraphValidationError(problems)

    # -- behaviour ----------------------------------------------------------------------------

    def init(self, ctx: TaskContext) -> None:
        """Called once when a plan runner is built, before the first iteration."""

    def run(self, ctx: TaskContext) -> None:
        """The task's work on its batch: read and write `ctx.slots`, use `ctx.stream` and `ctx.state`."""
        raise NotImplementedError(f"task '{self.name}' does not implement run(ctx)")

    @property
    def label(self) -> str:
        """Name shown in NVTX ranges and profiles."""
        return self.nvtx_tag or self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, stream={self.stream!r}, lookahead={self.lookahead})"


class FnTask(Task):
    """A Task built by `Task.from_fn`: `run(ctx)` is `fn(ctx)`."""

    def __init__(self, name: str, fn: Callable[[TaskContext], Any], **fields: Any):
        self.fn = fn
        declared = getattr(fn, _EFFECTS_ATTR, None)
        if declared is not None:
            fields.setdefault("effects", declared[0])
            fields.setdefault("io", declared[1])
        super().__init__(name, **fields)

    def run(self, ctx: TaskContext) -> None:
        """Call the wrapped `fn(ctx)`."""
        self.fn(ctx)

    def __repr__(self) -> str:
        fn = getattr(self.fn, "__qualname__", repr(self.fn))
        return f"FnTask({self.name!r}, fn={fn}, stream={self.stream!r}, lookahead={self.lookahead})"


_EFFECTS_ATTR = "__task_effects__"
F = TypeVar("F", bound=Callable[..., Any])


def declare_effects(effects: str, *io: DeclaredIO) -> Callable[[F], F]:
    """Declare a task function's effects outside its slots (and how to replay them).

    `Task.from_fn(name, fn)` (and so every plan file naming `fn`) takes `effects` and `io`
    from the declaration unless given explicitly:

        @declare_effects("fills the batch's context in place", DeclaredIO(capture, restore))
        def start(ctx): ...
    """
    if not isinstance(effects, str) or not effects:
        raise ValueError(f"effects must be a non-empty description, got {effects!r}")

    def mark(fn: F) -> F:
        setattr(fn, _EFFECTS_ATTR, (effects, tuple(io)))
        return fn

    return mark


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _items(value: Any) -> tuple:
    """Accept a single entry where a sequence is expected: `depends_on="x"` means `("x",)`."""
    if value is None:
        return ()
    if isinstance(value, (str, DataSlot)):
        return (value,)
    return tuple(value)


def _normalise_slots(value: Any, lookahead: int, field: str, bad: Callable) -> tuple[DataSlot, ...]:
    slots = []
    for index, item in enumerate(_items(value)):
        if isinstance(item, str):
            slot = DataSlot(item, lookahead)
        elif isinstance(item, DataSlot):
            slot = item
        elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str) and _is_int(item[1]):
            slot = DataSlot(item[0], item[1])
        else:
            bad(field, f"a slot is a name or [name, batch_offset], got {item!r}", index)
            continue
        if not slot.name:
            bad(field, "slot name must be non-empty", index)
        elif not _is_int(slot.batch_offset) or slot.batch_offset < 0:
            bad(field, f"slot '{slot.name}' has batch_offset {slot.batch_offset!r}; offsets must be >= 0", index)
        elif slot in slots:
            bad(field, f"slot {slot} is listed twice", index)
        else:
            slots.append(slot)
    return tuple(slots)


def _normalise_names(value: Any, field: str, own: str, bad: Callable) -> tuple[str, ...]:
    names: list[str] = []
    for index, item in enumerate(_items(value)):
        if not isinstance(item, str) or not item:
            bad(field, f"expected a task name, got {item!r}", index)
        elif item == own:
            bad(field, "a task cannot depend on itself", index)
        elif item in names:
            bad(field, f"'{item}' is listed twice", index)
        else:
            names.append(item)
    return tuple(names)


def _normalise_cross_iter(value: Any, own: str, bad: Callable) -> tuple[tuple[str, int], ...]:
    field = "cross_iter_depends_on"
    entries: list[tuple[str, int]] = []
    for index, item in enumerate(_items(value)):
        if isinstance(item, str):
            name, offset = item, -1
        elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
            name, offset = item
        else:
            bad(field, f"expected a task name or [name, -N], got {item!r}", index)
            continue
        if not _is_int(offset) or offset >= 0:
            bad(
                field,
                f"offset for '{name}' must be a negative integer -N (the batch N before this one), got {offset!r}",
                index,
            )
        elif not name:
            bad(field, "expected a task name", index)
        elif name == own:
            bad(field, "a task cannot depend on itself", index)
        elif any(existing == name for existing, _ in entries):
            bad(field, f"'{name}' is listed twice", index)
        else:
            entries.append((name, offset))
    return tuple(entries)
