"""Per-batch slot stores and the ring of in-flight batches.

Data and completion events move across iterations by rotating stores, never by copying values:
a value written for batch K stays in K's store, which slides one position down the ring per
internal iteration until batch K is trained and its store is dropped.

The event objects outlive the stores: when the ring drops a store, the store that takes the top
position inherits its events, and a producer records its event there again for its next batch
(`spare_event`). A CUDA event is made once per producer and ring position instead of once per
task and iteration. Recording it again is safe: every wait on the earlier record was issued
while that batch was in flight, before the ring dropped its store, and a wait keeps the record
it was issued against.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

_MISSING = object()


class SlotStore:
    """One batch's slot values plus the completion events of tasks that processed it."""

    __slots__ = ("_values", "_events", "_spare")

    def __init__(self, spare_events: dict[str, Any] | None = None) -> None:
        self._values: dict[str, Any] = {}
        self._events: dict[str, Any] = {}
        #: every event object this ring position has held, by producer, to be recorded again
        self._spare: dict[str, Any] = spare_events if spare_events is not None else {}

    def __getitem__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            present = ", ".join(sorted(self._values)) or "nothing"
            raise KeyError(f"slot '{name}' is empty in this batch's store (holds: {present})") from None

    def get(self, name: str, default: Any = None) -> Any:
        """The value of slot `name`, or `default` when the slot is empty."""
        return self._values.get(name, default)

    def set(self, name: str, value: Any) -> None:
        """Store `value` in slot `name`, replacing what was there."""
        self._values[name] = value

    def pop(self, name: str, default: Any = _MISSING) -> Any:
        """Remove slot `name` and return its value (KeyError when empty and no `default` is given)."""
        if default is _MISSING:
            return self._values.pop(name)
        return self._values.pop(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def keys(self):
        """The names of the slots that hold a value."""
        return self._values.keys()

    def record_event(self, producer: str, event: Any) -> None:
        """Keep `producer`'s completion event for this batch, where its consumers look it up."""
        self._events[producer] = event
        self._spare[producer] = event

    def event(self, producer: str) -> Any:
        """The event `producer` recorded for this batch, or None if it has not run on it."""
        return self._events.get(producer)

    def spare_event(self, producer: str) -> Any:
        """The event object `producer` recorded at this ring position for an earlier batch, to
        record again for this one (None: it has not recorded here yet)."""
        return self._spare.get(producer)

    def __repr__(self) -> str:
        return f"SlotStore(slots={sorted(self._values)}, events={sorted(self._events)})"


class BatchRing:
    """`size` slot stores; `at(k)` is the store of the batch k iterations ahead of the oldest."""

    __slots__ = ("_stores",)

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a BatchRing needs at least one store, got size={size}")
        self._stores = [SlotStore() for _ in range(size)]

    def __len__(self) -> int:
        return len(self._stores)

    def at(self, offset: int) -> SlotStore:
        """The store of the batch `offset` iterations ahead of the oldest in-flight batch.

        Args:
            offset: 0 (the batch being trained) .. `size - 1`.

        Returns:
            That batch's `SlotStore` (IndexError outside the ring)."""
        if not 0 <= offset < len(self._stores):
            raise IndexError(f"ring offset {offset} outside 0..{len(self._stores) - 1}")
        return self._stores[offset]

    def advance(self) -> None:
        """Drop offset 0, shift every store down by one, append an empty store on top (which
        keeps the dropped store's event objects, to record again)."""
        self._stores.append(SlotStore(self._stores.pop(0)._spare))

    def clear(self) -> None:
        """Replace every store by an empty one (drops every in-flight value and recorded event;
        the event objects stay, to record again)."""
        self._stores = [SlotStore(store._spare) for store in self._stores]
