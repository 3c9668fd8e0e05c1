"""The engine benchmark runs and prints its final JSON line (figures are not asserted here:
timings belong to benchmark runs, not unit tests)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_bench_engine_quick_reports_every_measure():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_engine.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) == {"machine", "sequential", "threaded", "scaling", "overlap", "plans", "targets"}
    assert set(report["scaling"]) == {f"{n}x{t}" for n in (1, 2, 4) for t in (10, 30, 100)}
    assert {key.split("/")[0] for key in report["plans"]} == {
        "serial",
        "sparse_dist",
        "hstu_sparse_dist",
        "hstu_prefetch",
    }
    assert report["plans"]["hstu_prefetch/hstu_default"]["us_per_step"]["median"] > 0
    assert report["overlap"]["ratio_vs_ideal"]["median"] > 0
    assert report["machine"]["repeats"] == 2
    assert set(report["targets"]["met"]) >= {"sequential_us_per_task", "threaded_us_per_task", "overlap_ratio_vs_ideal"}
    assert "targets met:" in out.stdout
