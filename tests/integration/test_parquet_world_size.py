"""A `data=parquet` run checkpointed on 2 ranks and resumed on 1 (and back on 2): with the global
batch size kept, across the runs every row of the epoch is trained exactly once, proved with
the batches' sample ids (gloo, CPU, ranks forked by `fork_ranks`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_pipe.testing import check_torchrun, fork_ranks, read_rank_results

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist" / "parquet_world_worker.py"


def _data(directory: Path) -> str:
    rng = np.random.default_rng(0)
    n = 700
    cols = {"label": pa.array(rng.integers(0, 2, n).astype(np.int8))}
    for i in range(13):
        cols[f"int_{i}"] = pa.array(rng.integers(0, 50, n))
    for i in range(26):
        cols[f"cat_{i}"] = pa.array(rng.integers(0, 1000, n))
    table = pa.table(cols)
    pq.write_table(table.slice(0, 300), directory / "a.parquet", row_group_size=50)
    pq.write_table(table.slice(300), directory / "b.parquet", row_group_size=90)
    return str(directory / "*.parquet")


def test_two_ranks_to_one_and_back_train_every_row_of_the_epoch_once(tmp_path):
    data = _data(tmp_path)
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    for out in (first, second, third):
        out.mkdir()
    # 700 rows, global batch 32: 21 batches per epoch; 2 ranks to step 7, 1 rank to 15, 2 ranks to 21
    check_torchrun(fork_ranks(WORKER, str(first), data, "2", "32", "7", nproc=2, timeout=300))
    check_torchrun(fork_ranks(WORKER, str(second), data, "1", "32", "15", str(first / "run"), nproc=1, timeout=300))
    check_torchrun(fork_ranks(WORKER, str(third), data, "2", "32", "21", str(second / "run"), nproc=2, timeout=300))
    runs = [read_rank_results(first, 2), read_rank_results(second, 1), read_rank_results(third, 2)]
    assert [r[0]["start"] for r in runs] == [0, 7, 15]
    assert {rank["batches_per_epoch"] for run in runs for rank in run} == {21}
    assert [len(r[0]["sample_ids"]) for r in runs] == [7, 8, 6]
    trained = [i for run in runs for rank in run for step in rank["sample_ids"] for i in step]
    assert all(len(step) == 32 // len(run) for run in runs for rank in run for step in rank["sample_ids"])
    assert len(trained) == 21 * 32 and len(set(trained)) == len(trained)
    assert max(trained) < 700
