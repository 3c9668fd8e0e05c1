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
exec "$ROOT/.venv/bin/python" -m pytest "$@"
