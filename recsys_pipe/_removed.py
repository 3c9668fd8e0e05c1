"""Names a module no longer has, each failing with a message that names its replacement.

Why: code written against an earlier version gets an AttributeError saying what to use instead,
rather than a bare "has no attribute".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

__all__ = ["removed_names"]


def removed_names(module: str, replacements: Mapping[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` (PEP 562) raising AttributeError for each removed name with its
    replacement: `__getattr__ = removed_names(__name__, {"OLD": "use NEW"})`."""

    def __getattr__(name: str) -> object:
        replacement = replacements.get(name)
        if replacement is not None:
            raise AttributeError(f"{module}.{name} was removed: {replacement}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
