"""`recsys-bench data --quick` runs every part end to end on tiny generated data and prints its
table, the ratios the targets name and a final JSON line.

Throughput figures are not asserted (they belong to benchmark runs, docs/benchmarks.md); the
report's structure is, and that every measurement moved data (samples > 0, a peak RSS)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recsys_pipe.testing import worker_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_data_quick_reports_every_part_and_the_target_ratios(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "recsys_pipe.bench.data", "--quick", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=220,
        cwd=ROOT,
        env=worker_env(PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = report["rows"]
    assert set(rows) == {
        "convert criteo (TSV -> Parquet)",
        "data=criteo in memory, 20000 rows",
        "raw pyarrow, 20000 rows",
        "data=parquet loader, 20000 rows",
        "data=parquet loader, 20000 rows, glibc mmap threshold fixed",
        "raw pyarrow, 40000 rows",
        "data=parquet loader, 40000 rows",
        "data=parquet loader, 40000 rows, glibc mmap threshold fixed",
        "raw pyarrow, sequences of 20",
        "data=parquet_sequences loader, length 20, 1 worker",
        "data=parquet_sequences loader, length 20, 2 workers",
        "train DLRM, data=criteo",
        "train DLRM, data=parquet",
        "train SASRec, data=sequences",
        "train SASRec, data=parquet_sequences",
        "data=movielens in memory, windows of 16",
        "data=parquet_sequences HSTU ranking loader, windows of 16",
        "train HSTU, data=movielens",
        "train HSTU, data=parquet_sequences",
    }
    for name, row in rows.items():
        assert row["samples_per_s"]["median"] > 0 and row["peak_memory_mib"]["median"] > 0, name
        assert row["peak_memory_mib"]["median"] >= row["peak_main_rss_mib"]["median"] > 0, name
    held = ("data=criteo in memory, 20000 rows", "data=movielens in memory, windows of 16")
    for name in ("raw pyarrow, 40000 rows", "data=parquet loader, 40000 rows", *held):
        assert rows[name]["first_batch_s"]["median"] >= 0 and rows[name]["bytes_per_sample"]["median"] > 0
    assert rows["data=parquet loader, 40000 rows"]["first_batch_s"]["median"] > 0  # a worker starts first
    assert (
        set(report["ratios"])
        == set(report["targets"])
        == {
            "loader_samples_per_s",
            "loader_over_raw_pyarrow",
            "sequence_loader_samples_per_s",
            "sequence_loader_one_worker_samples_per_s",
            "train_dlrm_parquet_over_memory",
            "train_sasrec_parquet_over_text",
            "loader_peak_memory_mib_largest",
            "loader_peak_memory_largest_over_smallest",
            "loader_peak_memory_largest_over_smallest_default_malloc",
            "loader_first_batch_s_largest",
            "loader_first_batch_largest_over_smallest",
            "convert_over_56000_rows_per_s",
            "ranking_loader_over_memory",
            "train_hstu_parquet_over_memory",
        }
    )
    assert "ratios against the targets:" in proc.stdout
    assert (tmp_path / "converted" / "criteo.parquet").is_file()  # --dir keeps the generated data
