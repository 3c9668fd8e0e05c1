"""Bad rows of the Parquet sources: `data.on_bad_row=skip` leaves them out of their batches,
counted per epoch and in total (over the replicas), and a resume stays bitwise exact (the other
batches hold the same rows); the default `fail` stops the run with one line naming the file,
the row and the column, printed once, and status.json says so. (`--check` and the statistics:
test_data_parquet.py; `recsys-data inspect --scan`: test_data_scan.py.)"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _process_group import one_rank_group

from recsys_pipe.testing import fit_resumed, fit_run, parquet_criteo_overrides, train_here

pytestmark = pytest.mark.timeout(300)

#: the bad rows of the Criteo-layout file: label 2, a negative id (modulo), a null dense value
BAD = {130: ("label", 2), 401: ("cat_3", -7), 577: ("int_5", None)}


@pytest.fixture
def info():
    """A group of this test's own: the tests that run recsys-train here tear theirs down."""
    with one_rank_group() as info:
        yield info


@pytest.fixture(scope="module")
def criteo(tmp_path_factory) -> str:
    """700 Criteo-layout rows, row groups of 100, three bad ones, no statistics (only decoding
    finds them)."""
    rng = np.random.default_rng(0)
    n = 700
    cols = {"label": rng.integers(0, 2, n).astype(np.int64)}
    cols |= {f"int_{i}": rng.integers(0, 100, n).astype(object) for i in range(13)}
    cols |= {f"cat_{i}": rng.integers(0, 2**20, n) for i in range(26)}
    for row, (column, value) in BAD.items():
        cols[column][row] = value
    table = pa.table({k: pa.array(list(v), pa.int64()) for k, v in cols.items()})
    path = tmp_path_factory.mktemp("bad") / "c.parquet"
    pq.write_table(table, path, row_group_size=100, write_statistics=False)
    return str(path)


def _run(path: str) -> list[str]:
    return [*parquet_criteo_overrides(path, 20), "data.on_bad_row=skip"]


def test_skipped_rows_leave_their_batch_and_a_resume_stays_exact(info, criteo, tmp_path):
    """9 batches an epoch (1 held out): the bad rows' batches are smaller, every other batch
    holds its 64 rows, each epoch skips the three, and a run checkpointed at step 7 and resumed
    trains bitwise the losses and rows of the uninterrupted run, under a lookahead plan with
    DataLoader workers."""
    base = _run(criteo)
    reference = fit_run(info, [*base, "pipeline=serial"])
    trained = [set(s.tolist()) for s in reference.sample_ids]
    assert not any(row in ids for row in BAD for ids in trained)  # never trained
    assert sorted(len(ids) for ids in trained).count(63) == 6 and len(trained) == 18  # one bad row each, twice
    assert reference.skipped == {"total": 6, "per_epoch": {1: 3, 2: 3}}
    plan = [*base, "pipeline=sparse_dist", "data.num_workers=2"]
    first, second = fit_resumed(info, plan, 7, tmp_path / "a")
    assert first.losses + second.losses == reference.losses
    assert [s.tolist() for s in first.sample_ids + second.sample_ids] == [s.tolist() for s in reference.sample_ids]
    assert first.skipped["total"] + second.skipped["total"] == 6  # each run counts what it trained


def test_a_bad_row_mid_run_fails_in_one_line_printed_once(criteo, tmp_path, capsys):
    args = [a for a in _run(criteo) if a != "data.on_bad_row=skip"]
    assert train_here(*args, "pipeline=serial", f"trainer.output_dir={tmp_path}") == 2
    err = capsys.readouterr().err
    line = f"error: data.path: {criteo}, row 130 (row group 1), column 'label': label 2 outside [0, 1]"
    assert err.count("label 2 outside [0, 1]") == 1 and line in err.splitlines()
    (status,) = tmp_path.glob("recsys-train/*/status.json")
    recorded = json.loads(status.read_text())
    assert recorded["status"] == "failed" and recorded["exit_code"] == 2
    assert recorded["message"] == line.removeprefix("error: ")


def test_skip_counts_go_to_the_log_metrics_and_status(criteo, tmp_path, capsys):
    args = [*_run(criteo), "pipeline=serial", "trainer.log_every=3", f"trainer.output_dir={tmp_path}"]
    assert train_here(*args) == 0
    err = capsys.readouterr().err
    assert "epoch 1/2 done at step 9 (3 bad row(s) skipped)" in err
    (run,) = tmp_path.glob("recsys-train/*")
    status = json.loads((run / "status.json").read_text())
    assert status["skipped_rows"] == {"total": 6, "per_epoch": {"1": 3, "2": 3}}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    assert last["step"] == 18 and last["skipped_rows"] == 6 and last["skipped_rows_epoch"] == 3


def test_skip_is_refused_for_a_source_that_reads_every_row_first(capsys, no_process_group):
    assert train_here("--check", "trainer=smoke", "data.on_bad_row=skip") == 2
    line = capsys.readouterr().err.splitlines()[0]
    assert line.startswith("error: data.on_bad_row: skip is for the Parquet sources")


def _sequences(path, rows: list[list[int]], ratings: list[list[float]] | None = None, metadata=None) -> str:
    columns = {"user_id": pa.array(range(len(rows))), "item_ids": pa.array(rows, pa.list_(pa.int64()))}
    if ratings is not None:
        columns["actions"] = pa.array(ratings, pa.list_(pa.float64()))
    pq.write_table(pa.table(columns).replace_schema_metadata(metadata), path, row_group_size=8, write_statistics=False)
    return str(path)


def test_hstu_ranking_and_retrieval_skip_their_bad_rows(info, tmp_path):
    """Windows (HSTU ranking): a row of no more events than num_candidates and a rating of 42;
    users (retrieval): an item outside the vocabulary. Each is skipped and counted; a skipped
    user is evaluation padding."""
    from recsys_pipe.data.parquet.decode import item_vocab_metadata

    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 30, 6).tolist() for _ in range(40)]
    ratings = [rng.integers(1, 6, 6).astype(float).tolist() for _ in range(40)]
    rows[5], ratings[5] = rows[5][:2], ratings[5][:2]  # 2 events, 2 candidates: no history
    ratings[17][1] = 42.0
    windows = _sequences(tmp_path / "w.parquet", rows, ratings)
    common = ["trainer=smoke", "trainer.max_steps=4", "trainer.eval_every=0", "trainer.tensorboard=false"]
    common += ["data.on_bad_row=skip", "data.batch_size=8", "trainer.eval_batches=1", "data.shuffle=false"]
    ranking = [*common, "model=hstu_small", "data=parquet_sequences", f"data.path={windows}"]
    ranking += ["data.max_seq_len=6", "data.num_candidates=2", "data.num_items=30"]
    summary = fit_run(info, ranking)
    assert summary.skipped == {"total": 2, "per_epoch": {1: 2}}
    assert not {5, 17} & {i for s in summary.sample_ids for i in s.tolist()}
    rows[9][3] = 999  # not in the stored vocabulary
    users = _sequences(tmp_path / "u.parquet", rows, None, item_vocab_metadata(np.arange(30)))
    retrieval = [*common, "model=sasrec", "data=parquet_sequences", f"data.path={users}", "trainer.eval_every=4"]
    retrieval += ["data.max_seq_len=4", "model.max_seq_len=4", "data.eval_negatives=5"]
    summary = fit_run(info, retrieval)
    assert summary.skipped == {"total": 1, "per_epoch": {1: 1}}
    assert summary.evals[-1]["users"]["valid"] == 38  # user 9 (skipped) and user 5 (2 items) are not scored
