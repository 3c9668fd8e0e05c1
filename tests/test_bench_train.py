"""scripts/bench_train.py runs end to end on 2 gloo ranks and prints its final JSON line.

Figures are not asserted (timings belong to benchmark runs); the script itself asserts that all
variants trained bitwise-equal per-step losses, so a zero exit code also means parity held.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLANS = {"serial", "hstu_sparse_dist", "hstu_prefetch"}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_train_runs_and_reports_ratios():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(ROOT / "scripts" / "bench_train.py"),
            "--steps",
            "3",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--batch-size",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {
        "samples_per_s",
        "ratio_vs_torchrec",
        "ratio_vs_serial",
        "engine_share",
        "steps",
        "repeats",
        "world_size",
    } <= set(report)
    assert set(report["samples_per_s"]) == PLANS | {"torchrec_sdd"}
    assert set(report["ratio_vs_torchrec"]) >= {"hstu_sparse_dist", "hstu_prefetch"}
    assert set(report["ratio_vs_serial"]) >= {"hstu_sparse_dist", "hstu_prefetch"}
    assert set(report["engine_share"]) == PLANS
    assert (report["steps"], report["repeats"], report["world_size"]) == (3, 1, 2)
    assert all(v > 0 for v in report["samples_per_s"].values())
