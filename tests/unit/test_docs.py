"""The README stays a short front page, and its links and the API reference keep up with the code.

`mkdocs build --strict` (scripts/test.sh) checks the pages under docs/ and resolves every
`::: name` of the API reference; the README is outside the site, so its links are checked here.
The griffe extension that documents the lazily exported packages is checked against their `__all__`.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
REFERENCE = ROOT / "docs" / "reference"
MAX_README_LINES = 200

# [text](target) and ![alt](target); the target ends at whitespace or ')'
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def relative_links(markdown: str) -> list[str]:
    """Link targets outside code blocks that point into the repository (no URL scheme, no bare anchor)."""
    text = FENCE.sub("", markdown)
    targets = [m.group(1) for m in LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def load_hook():
    path = ROOT / "docs" / "hooks" / "lazy_reference.py"
    spec = importlib.util.spec_from_file_location("lazy_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move detail into a page under docs/"
    )


def test_readme_links_resolve() -> None:
    links = relative_links(README.read_text(encoding="utf-8"))
    assert len(links) >= 10, f"the README's table of contents links into docs/, found only {links}"
    missing = [t for t in links if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_link_finder_sees_links_and_skips_code() -> None:
    text = "[a](docs/a.md) ![p](docs/p.png) [w](https://x.org) [s](#top) [b](docs/b.md#part)\n```\n[c](nope.md)\n```\n"
    assert relative_links(text) == ["docs/a.md", "docs/p.png", "docs/b.md#part"]


def public_packages() -> list[str]:
    """recsys_pipe's subpackages whose `__init__` declares a public API (`__all__`)."""
    found = []
    for init in sorted((ROOT / "recsys_pipe").glob("*/__init__.py")):
        if re.search(r"^__all__\s*=", init.read_text(encoding="utf-8"), re.MULTILINE):
            found.append(f"recsys_pipe.{init.parent.name}")
    return found


@pytest.mark.parametrize("package", public_packages())
def test_every_public_package_has_a_reference_page(package: str) -> None:
    name = package.rsplit(".", 1)[1]
    page = REFERENCE / f"{name}.md"
    assert page.is_file(), (
        f"{package} has a public API (__all__) but no API reference page: add {page.relative_to(ROOT)} "
        f"with the line '::: {package}' and list it under 'API reference' in mkdocs.yml's nav"
    )
    assert f"::: {package}\n" in page.read_text(encoding="utf-8")
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert f"reference/{name}.md" in nav, f"{page.relative_to(ROOT)} is not in mkdocs.yml's nav"


def lazy_packages() -> list[str]:
    """The public packages that export their names lazily (an `_EXPORTS` dict in `__init__`)."""
    hook = load_hook()
    return [p for p in public_packages() if hook.lazy_exports(p) is not None]


def test_some_packages_are_lazy() -> None:
    assert "recsys_pipe.train" in lazy_packages()


@pytest.mark.parametrize("package", lazy_packages())
def test_lazy_packages_are_documented_at_their_public_paths(package: str) -> None:
    """With the griffe extension, a lazy package exports its whole `__all__`, each name at
    `package.name` and resolving to its definition (what `::: package` renders)."""
    import griffe

    hook = load_hook()
    loaded = griffe.load(package, search_paths=[ROOT], extensions=griffe.load_extensions(hook.LazyExports))
    assert sorted(loaded.exports) == sorted(importlib.import_module(package).__all__)
    for name in loaded.exports:
        member = loaded.members[name]
        assert member.path == f"{package}.{name}"
        assert member.final_target.name == name, f"{package}.{name} does not resolve to a definition"


def test_hook_leaves_eagerly_exported_packages_alone() -> None:
    assert load_hook().lazy_exports("recsys_pipe.engine") is None
