"""The benchmark scripts run and print their final JSON line (figures are not asserted here:
timings belong to benchmark runs, not unit tests)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_engine_runs_and_reports_ratios():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_engine.py"),
            "--iterations",
            "50",
            "--repeats",
            "1",
            "--overlap-iterations",
            "10",
            "--sleep-ms",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) == {"sequential", "threaded", "overlap"}
    assert report["overlap"]["ratio_vs_ideal"] > 0 and report["sequential"]["overhead_us_per_task"] > 0
