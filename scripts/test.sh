#!/usr/bin/env bash
# Runs the linter, the format check, the docs build and the test suite (installing the environment
# first if needed). Extra args go to pytest, e.g. scripts/test.sh -q -k engine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
"$ROOT/.venv/bin/ruff" check .
"$ROOT/.venv/bin/ruff" format --check .
# The docs site: a broken link or anchor, a page missing from the nav or an API reference that no
# longer resolves fails here. Not --quiet: it keeps warnings from the strict count (mkdocs#4126).
NO_MKDOCS_2_WARNING=1 "$ROOT/.venv/bin/mkdocs" build --strict --site-dir "$ROOT/site"
# Two workers, one test file each at a time (--dist loadfile): a file's tests share its module
# fixtures (one torchrun launch for many checks). Run in one process, the suite keeps about one of
# two cores busy (CPU time / wall time ~1.1: process start-up, ranks waiting on each other); two
# workers fill the other. `-n 0` in "$@" turns it off.
exec "$ROOT/.venv/bin/python" -m pytest -n 2 --dist loadfile "$@"
