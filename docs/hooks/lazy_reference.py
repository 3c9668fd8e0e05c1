"""Griffe extension: give the API reference the public API of packages that export lazily.

`recsys_pipe.train`, `.runtime`, `.models` and `.data` import their public names on first use
(PEP 562, `recsys_pipe._lazy.lazy_exports`), so their `__all__` is computed (`sorted(_EXPORTS)`)
and a static reader such as griffe sees neither the names nor where they come from. `_EXPORTS`
itself is a literal `{name: submodule}` dict: this extension reads it with `ast` (nothing is
imported) and adds each name to the package as an alias of its definition, with the package's
exports set to those names. `::: recsys_pipe.train` then documents `recsys_pipe.train.Trainer`
at its public path, exactly like an eagerly exported package, and follows the package's
`__init__` as it changes. mkdocs.yml loads it (`extensions:` of the python handler).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parents[2]


def lazy_exports(package: str) -> dict[str, str] | None:
    """The package's `_EXPORTS` literal, or None when it has none.

    Args:
        package: a dotted package name under the repository root, e.g. `recsys_pipe.train`.

    Returns:
        `{public name: submodule it is defined in}`, read from the package's `__init__.py`.
    """
    init = ROOT.joinpath(*package.split("."), "__init__.py")
    if not init.is_file():
        return None
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


class LazyExports(griffe.Extension):
    """Adds a lazily exporting package's public names as aliases of their definitions."""

    def on_module_members(self, *, mod: griffe.Module, **kwargs: Any) -> None:
        """Called by griffe once a module's own members are loaded; acts on lazy packages only."""
        exports = lazy_exports(mod.path) if mod.is_init_module else None
        if exports is None:
            return
        for name, submodule in exports.items():
            mod.set_member(name, griffe.Alias(name, f"{mod.path}.{submodule}.{name}", parent=mod))
        mod.exports = sorted(exports, key=str.lower)
