"""Shortcut replay: skip a task's work and replay what it produced, to measure what it costs.

A plan runner with `enable_shortcut(names)` runs each named task once for real (the *caching run*)
and records what it did to its slots (its declared reads and writes): the slots it added or
replaced, with every tensor detached and cloned, and the slots it deleted. Every later run
skips the task's `run` and replays that record, so the tasks after it see the same kind of
inputs and do the same work, and the iteration time drops by what the skipped task added to it.

Gradients: a replayed tensor that required grad goes through `graft`, an autograd function
that returns it unchanged and, in backward, passes the incoming gradient on and hands zeros
to the task's grad-requiring inputs: the grad-requiring tensors in its read slots, and the
leaf tensors (parameters) its outputs were computed from directly. The backward graph stays
connected, so every parameter upstream still gets a gradient (DDP sees no unused parameter),
but the skipped task contributes exactly zero to it.

Effects outside the slots (module state, shared objects, an object in a slot changed in
place) are invisible to this record. A task declares them with `Task.effects` (a description)
and makes them replayable with `Task.io`, a tuple of `DeclaredIO(capture, restore)`: after the
caching run `capture(ctx)` snapshots the external state (cached like slot values), on every
replay `restore(ctx, value)` writes a fresh copy back. A task with effects and no `io` cannot
be shortcut: `enable_shortcut` refuses it and says why.

Collective order is kept: the executors order `nccl` tasks around the call that runs the task,
so a skipped collective still takes its turn (and skips its collective on every rank that
enabled the same shortcut).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from recsys_pipe.engine.context import TaskContext
    from recsys_pipe.engine.task import DataSlot, Task

__all__ = ["ShortcutRun", "graft", "shortcut_refusal"]

_MISSING = object()


def shortcut_refusal(task: Task) -> str | None:
    """Why `task` cannot be shortcut, or None when it can."""
    if task.effects and not task.io:
        return (
            f"task '{task.name}' cannot be shortcut: effects outside its slots and no DeclaredIO (Task.io) "
            f"to replay them: {task.effects}"
        )
    return None


class _Graft(torch.autograd.Function):
    """Identity forward; backward passes the gradient through and gives zeros to `inputs`."""

    @staticmethod
    def forward(ctx: Any, restored: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in inputs]
        return restored

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Allocated per backward: jagged inputs change shape from batch to batch.
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes))


def graft(restored: torch.Tensor, inputs: Iterable[torch.Tensor]) -> torch.Tensor:
    """`restored`, connected to `inputs` in the autograd graph with a zero gradient.

    Without grad-requiring inputs the result is a new grad-requiring leaf (backward through it
    stops there)."""
    inputs = tuple(inputs)
    if inputs:
        return _Graft.apply(restored, *inputs)
    return restored.requires_grad_(True)


class _Cached:
    """A tensor as cached: a detached clone, and whether the original required grad."""

    __slots__ = ("tensor", "requires_grad")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach().clone()
        self.requires_grad = tensor.requires_grad


def _cache_value(value: Any) -> Any:
    """Detach and clone every tensor at any depth of lists, tuples and dicts; keep other objects."""
    if isinstance(value, torch.Tensor):
        return _Cached(value)
    if isinstance(value, dict):
        return type(value)((k, _cache_value(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        items = [_cache_value(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _restore_value(value: Any, make: Callable[[_Cached], torch.Tensor]) -> Any:
    if isinstance(value, _Cached):
        return make(value)
    if isinstance(value, dict):
        return type(value)((k, _restore_value(v, make)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        items = [_restore_value(v, make) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _grad_tensors(value: Any) -> list[torch.Tensor]:
    """Grad-requiring tensors at any depth of lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, dict):
        return [t for v in value.values() for t in _grad_tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _grad_tensors(v)]
    return []


def _own_leaves(outputs: list[torch.Tensor], upstream: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors (parameters) `outputs` were computed from without going through
    `upstream`: what the task itself brought into the graph."""
    stop = {id(t.grad_fn) for t in upstream if t.grad_fn is not None}
    upstream_ids = {id(t) for t in upstream}
    seen: dict[int, Any] = {}  # id -> node, holding the nodes so ids stay unique while walking
    leaves: dict[int, torch.Tensor] = {}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if isinstance(variable, torch.Tensor):
            if id(variable) not in upstream_ids:
                leaves.setdefault(id(variable), variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


class _Record:
    """What the caching run did: slots produced and deleted, where the grad-requiring inputs
    are, the task's own leaves, and the captured external state."""

    __slots__ = ("produced", "deleted", "upstream_slots", "own_leaves", "io_values")

    def __init__(self, produced, deleted, upstream_slots, own_leaves, io_values):
        self.produced: tuple[tuple[DataSlot, Any], ...] = produced
        self.deleted: tuple[DataSlot, ...] = deleted
        self.upstream_slots: tuple[DataSlot, ...] = upstream_slots
        self.own_leaves: tuple[torch.Tensor, ...] = own_leaves
        self.io_values: tuple[Any, ...] = io_values


class ShortcutRun:
    """Runs a shortcut task: the first call runs it and records, later calls replay.

    Installed by `PlanRunner.enable_shortcut` in place of `task.run`; one per task, and a
    task never runs twice at once, so no locking is needed.
    """

    __slots__ = ("task", "slots", "record")

    def __init__(self, task: Task):
        self.task = task
        self.slots: tuple[DataSlot, ...] = tuple(dict.fromkeys((*task.reads, *task.writes)))
        self.record: _Record | None = None

    @property
    def cached(self) -> bool:
        return self.record is not None

    def __call__(self, ctx: TaskContext) -> None:
        if self.record is None:
            self.record = self._run_and_record(ctx)
        else:
            self._replay(ctx)

    def _run_and_record(self, ctx: TaskContext) -> _Record:
        ring, task = ctx.ring, self.task
        before = {s: ring.at(s.batch_offset).get(s.name, _MISSING) for s in self.slots}
        task.run(ctx)
        after = {s: ring.at(s.batch_offset).get(s.name, _MISSING) for s in self.slots}
        changed = [s for s in self.slots if after[s] is not _MISSING and after[s] is not before[s]]
        deleted = tuple(s for s in self.slots if before[s] is not _MISSING and after[s] is _MISSING)
        upstream_slots = tuple(
            s for s in task.reads if after[s] is before[s] and before[s] is not _MISSING and _grad_tensors(before[s])
        )
        upstream = [t for s in upstream_slots for t in _grad_tensors(before[s])]
        outputs = [t for s in changed for t in _grad_tensors(after[s])]
        own = tuple(_own_leaves(outputs, upstream)) if outputs else ()
        produced = tuple((s, _cache_value(after[s])) for s in changed)
        io_values = tuple(_cache_value(io.capture(ctx)) for io in task.io)
        return _Record(produced, deleted, upstream_slots, own, io_values)

    def _replay(self, ctx: TaskContext) -> None:
        ring, record = ctx.ring, self.record
        assert record is not None
        for slot in record.deleted:
            ring.at(slot.batch_offset).pop(slot.name, None)
        inputs: list[torch.Tensor] | None = None

        def restore(cached: _Cached) -> torch.Tensor:
            nonlocal inputs
            tensor = cached.tensor.detach()  # a new tensor object on the cache's storage: no copy
            if not cached.requires_grad or not torch.is_grad_enabled():
                return tensor
            if inputs is None:  # this batch's grad-requiring inputs, found once per replay
                current = [ring.at(s.batch_offset).get(s.name) for s in record.upstream_slots]
                inputs = [t for value in current for t in _grad_tensors(value)] + list(record.own_leaves)
            return graft(tensor, inputs)

        for slot, value in record.produced:
            ring.at(slot.batch_offset).set(slot.name, _restore_value(value, restore))
        for io, value in zip(self.task.io, record.io_values):
            io.restore(ctx, _restore_value(value, lambda cached: cached.tensor.clone()))
