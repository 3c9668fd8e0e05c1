"""`python -m recsys_pipe.bench.shuffle` runs end to end on 2 gloo ranks and prints its final JSON line.

Throughput figures are not asserted (they belong to benchmark runs). The imbalance figures are
deterministic (seeded data, no timing), so they are: balancing must lower the per-rank workload
imbalance. The script itself asserts that each balanced step trained exactly the loaded samples.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recsys_pipe.testing import worker_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_shuffle_reports_imbalance_and_ratios():
    proc = subprocess.run(
        [sys.executable, "-m", "recsys_pipe.bench.shuffle", "--steps", "3", "--warmup", "1", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
        env=worker_env(PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    imbalance = report["imbalance"]
    assert imbalance["workload_after"]["mean"] < imbalance["workload_before"]["mean"]
    assert imbalance["workload_after"]["worst"] < imbalance["workload_before"]["worst"]
    assert imbalance["workload_after"]["mean"] >= 1.0
    assert set(report["ratio_balanced_vs_unbalanced"]) == {"hstu_sparse_dist_balanced", "hstu_prefetch_balanced"}
    assert report["world_size"] == 2
