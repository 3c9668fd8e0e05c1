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
from _bench import bench_report

from recsys_pipe.bench.hstu import _REFERENCE_FILE, LEVERS_OFF, REFERENCE_ENV, write_ml1m_shaped

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = os.environ.get(REFERENCE_ENV, "")


@pytest.mark.timeout(240)
@pytest.mark.skipif(
    not (REFERENCE and (Path(REFERENCE) / _REFERENCE_FILE).is_file()),
    reason=f"needs a clone of meta-recsys/generative-recommenders: set {REFERENCE_ENV} to its path",
)
def test_recsys_bench_hstu_quick_trains_both_and_prints_the_ratio():
    report, _ = bench_report("hstu", "--quick", "--levers", "--reference", REFERENCE, timeout=220)
    assert set(report["wall"]) == set(report["cpu"]) == {*LEVERS_OFF, "reference", "reference, shared negatives"}
    assert report["ratio"] == report["wall"]["all levers"]["over_reference"]["median"] > 0
    assert report["sizes"]["attn_len"] == report["sizes"]["data_len"] + 11


@pytest.mark.timeout(240)
@pytest.mark.skipif(
    not (REFERENCE and (Path(REFERENCE) / _REFERENCE_FILE).is_file()),
    reason=f"needs a clone of meta-recsys/generative-recommenders: set {REFERENCE_ENV} to its path",
)
def test_the_reference_trains_on_sequences_and_reaches_the_retrieval_report(tmp_path):
    """`hstu_train_reference` (what scripts/reproduce_games_hstu.sh runs for the reference) writes
    the records `retrieval_report` reads: its row is printed beside ours."""
    data = write_ml1m_shaped(tmp_path / "ratings.dat", users=120)
    run = [sys.executable, "-m", "recsys_pipe.bench.hstu_train_reference", "--reference", REFERENCE]
    out_dir = tmp_path / "runs" / "hstu_reference"
    options = ["--data", str(data), "--out", str(out_dir), "--epochs", "2", "--eval-epochs", "1", "--batch", "32"]
    subprocess.run([*run, *options, "--dim", "16", "--negatives", "16"], cwd=ROOT, timeout=200, check=True)
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2] and records[0]["selected"]
    assert records[0]["users"] == {"valid": 120, "test": 120}
    report = subprocess.run(
        [sys.executable, "-m", "recsys_pipe.bench.retrieval_report", str(tmp_path / "runs")],
        capture_output=True,
        cwd=ROOT,
        text=True,
        timeout=60,
        check=True,
    )
    assert "ref. HSTU (gen-rec)" in report.stdout
    summary = json.loads(report.stdout.strip().splitlines()[-1])
    chosen = max(records, key=lambda r: r["valid"]["sampled"]["HR@10"])
    assert summary["hstu_reference"]["sampled"] == chosen["test"]["sampled"]


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


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not (REFERENCE and (Path(REFERENCE) / _REFERENCE_FILE).is_file()),
    reason=f"needs a clone of meta-recsys/generative-recommenders: set {REFERENCE_ENV} to its path",
)
def test_reproduce_games_hstu_script_reports_ours_the_reference_and_large(tmp_path):
    """scripts/reproduce_games_hstu.sh end to end on a small file (1 epoch each): one report
    with the three runs on both protocols, and its JSON line."""
    data = write_ml1m_shaped(tmp_path / "ratings.dat", users=300)
    epochs = {"EPOCHS": "1", "OURS_EPOCHS": "1", "LARGE_EPOCHS": "1", "EVAL_EPOCHS": "1"}
    env = {**os.environ, **epochs, "EXTRA": "trainer.tensorboard=false"}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "reproduce_games_hstu.sh"), str(data), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    for row in ("ours hstu ", "ref. HSTU (gen-rec) ", "ours hstu_large ", "ref. HSTU (gen-rec) full"):
        assert any(line.startswith(row) for line in lines), (row, lines)
    summary = json.loads(lines[-1])
    for run in ("hstu", "hstu_reference", "hstu_large"):
        assert summary[run]["users"] == 300 and 0 <= summary[run]["full"]["HR@10"] <= 1
        assert summary["train_s"][run] >= 1


@pytest.mark.timeout(120)
def test_reproduce_games_hstu_script_checks_its_inputs_before_training(tmp_path):
    """A clone that is not the reference, then (with a stand-in clone) a missing data file: each
    exits 2 with one `error:` line naming what is wrong, and nothing is written to OUT_DIR."""
    out_dir = tmp_path / "out"

    def script(data: Path, clone: Path) -> subprocess.CompletedProcess:
        command = ["bash", str(ROOT / "scripts" / "reproduce_games_hstu.sh"), str(data), str(out_dir)]
        env = {**os.environ, REFERENCE_ENV: str(clone)}
        return subprocess.run(command, capture_output=True, text=True, timeout=100, env=env)

    not_a_clone = script(write_ml1m_shaped(tmp_path / "ratings.dat", users=20), tmp_path)
    assert not_a_clone.returncode == 2
    assert not_a_clone.stderr.strip() == f"error: {REFERENCE_ENV}: {tmp_path} is not a clone of generative-recommenders"
    clone = tmp_path / "clone"
    (clone / _REFERENCE_FILE).parent.mkdir(parents=True)
    (clone / _REFERENCE_FILE).touch()
    missing = tmp_path / "Video.txt"
    no_data = script(missing, clone)
    assert no_data.returncode == 2
    assert no_data.stderr.strip() == f"error: data.path: no such file: {missing}"
    assert not out_dir.exists()
