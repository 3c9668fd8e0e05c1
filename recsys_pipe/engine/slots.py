"""Per-batch slot stores and the ring of in-flight batches.

Data and completion events move across iterations by rotating stores, never by copying values:
a value written for batch K stays in K's store, which slides one position down the ring per
internal iteration until batch K is trained and its store is dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

_MISSING = object()


class SlotStore:
    """One batch's slot values plus the completion events of tasks that processed it."""

    __slots__ = ("_values", "_events")

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}
        self._events: dict[str, Any] = {}

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

    def event(self, producer: str) -> Any:
        """The event `producer` recorded for this batch, or None if it has not run on it."""
        return self._events.get(producer)

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
        """Drop offset 0, shift every store down by one, append an empty store on top."""
        del self._stores[0]
        self._stores.append(SlotStore())

    def clear(self) -> None:
        """Replace every store by an empty one (drops every in-flight value and event)."""
        self._stores = [SlotStore() for _ in self._stores]
