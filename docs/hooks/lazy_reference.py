"""MkDocs hook: expand `::: package` for packages that export their names lazily.

`recsys_pipe.train`, `.models` and `.data` import their public names on first use (PEP 562,
`recsys_pipe._lazy.lazy_exports`), so their `__all__` is computed (`sorted(_EXPORTS)`) and a
static reader such as griffe cannot list it. `_EXPORTS` itself is a literal `{name: submodule}`
dict: this hook reads it with `ast` (nothing is imported) and replaces the page's
`::: recsys_pipe.train` line by one `::: recsys_pipe.train.<submodule>.<name>` block per public
name, so the reference follows the package's `__init__` as it changes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIRECTIVE = re.compile(r"^::: (recsys_pipe(?:\.\w+)*)[ \t]*$", re.MULTILINE)


def lazy_exports(package: str) -> dict[str, str] | None:
    """`{name: submodule}` from the package's `_EXPORTS` literal, or None when it has none."""
    init = ROOT.joinpath(*package.split("."), "__init__.py")
    if not init.is_file():
        return None
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def expand(match: re.Match[str]) -> str:
    package = match.group(1)
    exports = lazy_exports(package)
    if exports is None:
        return match.group(0)
    blocks = [f"::: {package}.{exports[name]}.{name}" for name in sorted(exports, key=str.lower)]
    return f"::: {package}\n    options:\n      members: false\n\n" + "\n\n".join(blocks)


def on_page_markdown(markdown: str, **_: object) -> str:
    return DIRECTIVE.sub(expand, markdown)
