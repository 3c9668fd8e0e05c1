"""The shape of the code, read from the source (AST): no function of recsys_pipe is longer than
80 lines, except where docs/design.md says why (`LONG_FUNCTIONS`)."""

from __future__ import annotations

import ast
from pathlib import Path

import recsys_pipe

PACKAGE = Path(recsys_pipe.__file__).parent
ROOT = PACKAGE.parent
MAX_LINES = 80
#: `path:function` -> why it is longer; each must be named on docs/design.md too
LONG_FUNCTIONS: dict[str, str] = {}


def _function_lengths(source: str) -> list[tuple[str, int]]:
    """(name, lines) of every function and method of `source`, decorators and docstring included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            found.append((node.name, node.end_lineno - start + 1))
    return found


def test_no_function_is_longer_than_80_lines():
    long = sorted(
        f"{path.relative_to(ROOT)}:{name} ({lines} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, lines in _function_lengths(path.read_text())
        if lines > MAX_LINES and f"{path.relative_to(ROOT)}:{name}" not in LONG_FUNCTIONS
    )
    assert not long, f"functions over {MAX_LINES} lines (split them, or say why on docs/design.md): {long}"


def test_the_long_functions_kept_are_explained_on_the_design_page():
    design = (ROOT / "docs" / "design.md").read_text()
    assert all(where.split(":")[1] in design for where in LONG_FUNCTIONS), LONG_FUNCTIONS


def test_the_length_check_counts_decorators_and_docstrings():
    source = "@deco\ndef f():\n    '''doc\n    more'''\n    return 1\n"
    assert _function_lengths(source) == [("f", 5)]
