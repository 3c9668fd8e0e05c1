"""`recsys-bench compile`: eager and compiled runs side by side, their loss deviation checked
(figures are not asserted here: timings belong to benchmark runs)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(200)
def test_bench_compile_reports_both_and_aot_eager_trains_the_eager_bits():
    out = subprocess.run(
        [sys.executable, "-m", "recsys_pipe.bench", "compile", "--steps", "3", "--warmup", "1", "--reps", "2"]
        + ["--backend", "aot_eager", "model.dropout=0.2"],
        capture_output=True,
        cwd=ROOT,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report["ms_per_step"]) == {"eager", "compiled"}
    assert report["ratio_compiled_over_eager"]["median"] > 0
    assert report["compile"]["compile_graphs"] > 0 and report["compile"]["compile_graph_breaks"] > 0
    assert report["deviation"]["max_abs"] == 0.0  # aot_eager generates no code: the eager bits
    assert (report["deviation"]["rtol"], report["deviation"]["atol"]) == (1e-5, 1e-6)  # the stated tolerance
