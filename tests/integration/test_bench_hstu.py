"""`recsys-bench hstu --quick`: ours and generative-recommenders' HSTU train side by side through
the benchmark's own main, every lever variant included, and its last line is the JSON report
(figures are not asserted: timings belong to benchmark runs). Needs a clone of the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recsys_pipe.bench.hstu import _REFERENCE_FILE, LEVERS_OFF, REFERENCE_ENV

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = os.environ.get(REFERENCE_ENV, "")


@pytest.mark.timeout(240)
@pytest.mark.skipif(
    not (REFERENCE and (Path(REFERENCE) / _REFERENCE_FILE).is_file()),
    reason=f"needs a clone of meta-recsys/generative-recommenders: set {REFERENCE_ENV} to its path",
)
def test_recsys_bench_hstu_quick_trains_both_and_prints_the_ratio():
    out = subprocess.run(
        [sys.executable, "-m", "recsys_pipe.bench", "hstu", "--quick", "--levers", "--reference", REFERENCE],
        capture_output=True,
        cwd=ROOT,
        text=True,
        timeout=220,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report["wall"]) == set(report["cpu"]) == {*LEVERS_OFF, "reference", "reference, shared negatives"}
    assert report["ratio"] == report["wall"]["all levers"]["over_reference"]["median"] > 0
    assert report["sizes"]["attn_len"] == report["sizes"]["data_len"] + 11


def test_recsys_bench_hstu_refuses_a_directory_that_is_not_the_reference(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "recsys_pipe.bench", "hstu", "--quick", "--reference", str(tmp_path)],
        capture_output=True,
        cwd=ROOT,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert f"{tmp_path} is not a clone of generative-recommenders" in out.stderr.strip().splitlines()[-1]
