"""The pipeline-parallel benchmark runs end to end and reports every measure (figures are not
asserted: timings belong to benchmark runs on a quiet machine, not to unit tests)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # torchrun launches

ROOT = Path(__file__).resolve().parents[2]


def test_bench_pp_quick_reports_every_schedule_and_draws_gantts(tmp_path):
    schedules = ["1f1b", "zb_h1", "dualpipev"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "recsys_pipe.bench.pp",
            "--quick",
            "--out",
            str(tmp_path),
            "--schedules",
            *schedules,
        ],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(report["schedules"]) == schedules
    for name in schedules:
        row = report["schedules"][name]
        assert row["ours_ms"]["median"] > 0 and row["torch_ms"]["median"] > 0 and row["simulated_ms"]["min"] > 0
        assert row["recorded_ms"]["min"] > 0 and row["recorded_over_simulated"]["min"] > 0
        assert (
            row["t_comm_ms"]["min"] > 0 and row["t_send_ms"]["min"] > 0
        )  # the measured transfer costs fed to simulate()
        assert row["engine_gap_us"] >= 0 and row["send_ms_per_step"]["min"] > 0
        assert (tmp_path / f"{name}_measured.png").is_file() and (tmp_path / f"{name}_simulated.png").is_file()
    assert set(report["zb_gains_vs_1f1b"]) == {"zb_h1"}
    assert "| schedule | ours ms | torch ms | torch / ours | t_comm ms |" in out.stdout
