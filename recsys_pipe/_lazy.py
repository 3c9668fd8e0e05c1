"""Package namespaces whose names are imported on first use (PEP 562 module `__getattr__`).

Why: `recsys_pipe.data`, `.models` and `.train` re-export names from modules that need torchrec;
importing a package must not load them, so that a plain-torch model trains where torchrec is not
installed, and choosing one model does not import the others.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package` whose public `name` lives in submodule `exports[name]`.

    Usage in a package's `__init__.py`:

        _EXPORTS = {"Trainer": "trainer", ...}
        __all__ = sorted(_EXPORTS)
        __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
    """
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module '{package}' has no attribute '{name}'")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
