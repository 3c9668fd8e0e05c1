#!/usr/bin/env bash
# Runs the linter, the format check and the test suite (installing the environment first if
# needed). Extra args go to pytest, e.g. scripts/test.sh -q -k engine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
"$ROOT/.venv/bin/ruff" check .
"$ROOT/.venv/bin/ruff" format --check .
exec "$ROOT/.venv/bin/python" -m pytest "$@"
