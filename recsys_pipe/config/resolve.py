"""Turn an import path into the function it names: a task's `fn:` or a component's `builder:`.

One syntax for the user's code everywhere in the configs: `pkg.module:function` (the module to
import, a colon, the attribute -- possibly dotted, `pkg.module:Class.method`), as in Python entry
points. The dotted `pkg.module.function` that plans used before the task registry keeps working:
the longest importable module prefix is imported and the rest looked up as attributes. Hydra's
`_target_` is not read (a section that sets it gets an error naming `fn:` or `builder:`).
Shipped tasks are named, not imported by path: `fn: h2d` (`recsys_pipe.config.task_registry`).

Why injectable: compiling a plan's *structure* (order, streams, waits) needs no task code, and
task code pulls in torchrec/CUDA. `compile_plan(..., resolve_fn=structure_only)` checks a plan
on any machine; the default `import_fn` imports the code and reports a bad path as a config
error naming the import failure.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["FnResolveError", "import_fn", "structure_only", "ResolveFn"]

#: `resolve_fn(path) -> callable`; raises FnResolveError (or any exception) when it cannot.
ResolveFn = Callable[[str], Callable[..., Any]]


class FnResolveError(ValueError):
    """`fn` does not name an importable callable; the message says why."""


def import_fn(path: str) -> Callable[..., Any]:
    """Import `pkg.module:func` (or `pkg.module:Class.method`; the dotted `pkg.module.func` of
    earlier plans works too). FnResolveError saying why when it cannot."""
    path = path.strip()
    if not path:
        raise FnResolveError("empty import path")
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
        parts = attr_path.split(".") if attr_path else []
        if not module_name or not parts or not all(parts):
            raise FnResolveError(f"'{path}' is not an import path (expected pkg.module:func)")
        module = _import(module_name, path)
    else:
        names = path.split(".")
        if len(names) < 2 or not all(names):
            raise FnResolveError(f"'{path}' is not an import path (expected pkg.module.func)")
        module, parts, missing = None, [], None
        # The longest importable module prefix; the rest are attributes.
        for cut in range(len(names) - 1, 0, -1):
            module_name = ".".join(names[:cut])
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
                    # The module exists but something it imports does not.
                    raise FnResolveError(f"importing '{module_name}' failed: {type(exc).__name__}: {exc}") from exc
                missing = missing or exc
                continue
            except Exception as exc:
                raise FnResolveError(f"importing '{module_name}' failed: {type(exc).__name__}: {exc}") from exc
            parts = names[cut:]
            break
        if module is None or (missing is not None and not hasattr(module, parts[0])):
            raise FnResolveError(f"cannot import '{path}': {missing}")
    obj: Any = module
    where = module.__name__
    for part in parts:
        if not hasattr(obj, part):
            raise FnResolveError(
                f"module '{module.__name__}' has no attribute '{'.'.join(parts)}'"
                if obj is module
                else f"'{where}' has no attribute '{part}'"
            )
        obj = getattr(obj, part)
        where += f".{part}"
    if not callable(obj) or isinstance(obj, type(importlib)):
        raise FnResolveError(f"'{path}' is a {type(obj).__name__}, not a function fn(ctx)")
    return obj


def _import(module_name: str, path: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise FnResolveError(f"cannot import '{path}': {exc}") from exc
    except Exception as exc:
        raise FnResolveError(f"importing '{module_name}' failed: {type(exc).__name__}: {exc}") from exc


def structure_only(path: str) -> Callable[..., Any]:
    """A stand-in that never imports: for compiling a plan's structure without its code."""

    def not_loaded(ctx: Any) -> None:
        raise RuntimeError(f"task function '{path}' was not imported (plan compiled structure-only)")

    not_loaded.__qualname__ = not_loaded.__name__ = path
    return not_loaded
