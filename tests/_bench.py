"""Shared by the benchmark tests: run `recsys-bench NAME ARGS` (as `python -m recsys_pipe.bench`)
from the repository root and read the JSON report every benchmark prints as its last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def bench_report(*args: str, timeout: float) -> tuple[dict[str, Any], str]:
    """The report of `recsys-bench ARGS` and everything it printed; fails with the end of its
    stderr unless it exits 0."""
    out = subprocess.run(
        [sys.executable, "-m", "recsys_pipe.bench", *args], capture_output=True, cwd=ROOT, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stdout
