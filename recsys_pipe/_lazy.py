"""Package namespaces whose names are imported on first use (PEP 562 module `__getattr__`).

Why: `recsys_pipe.data`, `.models` and `.train` re-export names from modules that need torchrec;
importing a package must not load them, so that a plain-torch model trains where torchrec is not
installed, and choosing one model does not import the others.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports", "refuse_moved_modules"]


def lazy_exports(
    package: str, exports: Mapping[str, str], moved: Mapping[str, str] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package` whose public `name` lives in submodule `exports[name]`.

    `moved` maps names that used to be exported here to the package that exports them now: they
    keep working, with a DeprecationWarning naming the new place.

    Usage in a package's `__init__.py`:

        _EXPORTS = {"Trainer": "trainer", ...}
        __all__ = sorted(_EXPORTS)
        __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
    """
    namespace = importlib.import_module(package).__dict__
    moved = moved or {}

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None and name in moved:
            warnings.warn(f"{package}.{name} moved: import it from {moved[name]}", DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(moved[name]), name)
        if module is None:
            raise AttributeError(f"module '{package}' has no attribute '{name}'")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


class _MovedModules(importlib.abc.MetaPathFinder):
    """Refuses to import a module that moved, with an ImportError naming where it is now (so an
    old import fails with the fix in its message instead of a bare 'No module named')."""

    def __init__(self, moved: Mapping[str, str]):
        self.moved = dict(moved)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.moved:
            raise ImportError(f"{fullname} moved to {self.moved[fullname]}", name=fullname)
        return None


def refuse_moved_modules(moved: Mapping[str, str]) -> None:
    """Make `import old.module` fail with 'old.module moved to new.module' for each entry."""
    sys.meta_path.insert(0, _MovedModules(moved))
