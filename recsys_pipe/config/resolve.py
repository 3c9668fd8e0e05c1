"""Turn an import path into the function it names: a task's `fn:` or a component's `builder:`.

One syntax for the user's code everywhere in the configs: `pkg.module:function` (the module to
import, a colon, the attribute -- possibly dotted, `pkg.module:Class.method`), as in Python entry
points; any other spelling (the dotted `pkg.module.function` of earlier plans) is refused with
the colon form to write instead (`check_import_path`). Hydra's `_target_` is not read (a
section that sets it gets an error naming `fn:` or `builder:`).
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

__all__ = ["FnResolveError", "check_import_path", "import_fn", "structure_only", "ResolveFn"]

#: `resolve_fn(path) -> callable`; raises FnResolveError (or any exception) when it cannot.
ResolveFn = Callable[[str], Callable[..., Any]]


class FnResolveError(ValueError):
    """`fn` does not name an importable callable; the message says why."""


def check_import_path(path: str) -> tuple[str, list[str]]:
    """The module and attribute names of `pkg.module:attr` (`attr` possibly dotted).

    Raises:
        FnResolveError: `path` is spelled otherwise; for a dotted `pkg.module.func` the message
            names the colon form to write instead.
    """
    module_name, colon, attr_path = path.strip().partition(":")
    parts = attr_path.split(".") if attr_path else []
    if colon and module_name and parts and all(parts):
        return module_name, parts
    hint = ""
    if not colon and "." in path.strip(".") and all(path.split(".")):
        head, _, tail = path.rpartition(".")
        hint = f" ('{head}:{tail}')"
    raise FnResolveError(f"'{path}' is not an import path: write pkg.module:function{hint}")


def import_fn(path: str) -> Callable[..., Any]:
    """Import `pkg.module:func` (or `pkg.module:Class.method`). FnResolveError saying why when it
    cannot, or when `path` is spelled otherwise (`check_import_path`)."""
    path = path.strip()
    if not path:
        raise FnResolveError("empty import path")
    module_name, parts = check_import_path(path)
    module = _import(module_name, path)
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
