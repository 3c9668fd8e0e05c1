"""A text file and its `recsys-data convert` Parquet train bitwise the same losses (in process, 1
rank, gloo, `data.shuffle=false`): Criteo TSV rows under DLRM (`data=criteo` against
`data=parquet`) and a "user item" file in the Games file's format under SASRec (`data=sequences`
against `data=parquet_sequences`), on the same batches (their sample ids)."""

from __future__ import annotations

import numpy as np
import pytest
from _process_group import one_rank_group

from recsys_pipe.cli.data import main as recsys_data
from recsys_pipe.testing import fit_run

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def info():
    with one_rank_group() as info:
        yield info


def _criteo_rows(n: int) -> str:
    """Criteo rows with empty fields, small negatives and ids of several widths."""
    rng = np.random.default_rng(3)
    lines = []
    for i in range(n):
        ints = ["" if rng.random() < 0.2 else str(int(v)) for v in rng.integers(-2, 5000, 13)]
        cats = ["" if rng.random() < 0.1 else f"{int(v):x}".zfill(8) for v in rng.integers(0, 2**40, 26)]
        lines.append("\t".join([str(int(rng.random() < 0.3 + 0.4 * (i % 3 == 0))), *ints, *cats]))
    return "\n".join(lines) + "\n"


def test_a_criteo_file_and_its_parquet_train_the_same_losses(info, tmp_path):
    tsv = tmp_path / "day_0"
    tsv.write_text(_criteo_rows(640))
    assert recsys_data(["convert", "criteo", str(tsv), str(tmp_path / "pq"), "--row-group-size", "100"]) == 0
    common = [
        "trainer=smoke",
        "trainer.max_steps=12",
        "trainer.eval_every=0",
        "trainer.eval_batches=0",
        "trainer.tensorboard=false",
        "model=dlrm",
        "data.num_embeddings=97",
        "data.batch_size=48",
        "data.shuffle=false",
    ]
    text = fit_run(info, [*common, "data=criteo", f"data.path={tsv}"])
    parquet = fit_run(info, [*common, "data=parquet", f"data.path={tmp_path / 'pq'}"])
    assert len(text.losses) == 12
    assert [s.tolist() for s in parquet.sample_ids] == [s.tolist() for s in text.sample_ids]
    assert parquet.losses == text.losses  # bitwise: floats compared with ==


def test_a_user_item_file_and_its_parquet_train_the_same_losses(info, tmp_path):
    """The Games file's format: "user item" lines, each user's lines in time order; every user has
    at least 4 (2 training transitions), since data=sequences skips the users with fewer while
    data=parquet_sequences keeps them as samples without targets (batches follow from row counts)."""
    rng = np.random.default_rng(5)
    lines = [f"{user} {int(item)}" for user in range(1, 61) for item in rng.integers(1, 90, rng.integers(4, 14))]
    games = tmp_path / "Games.txt"
    games.write_text("\n".join(lines) + "\n")
    assert recsys_data(["convert", "sequences", str(games), str(tmp_path / "pq")]) == 0
    common = [
        "trainer=smoke",
        "trainer.max_steps=8",
        "trainer.epochs=2",
        "trainer.eval_every=4",
        "trainer.tensorboard=false",
        "model=sasrec",
        "model.max_seq_len=10",
        "data.max_seq_len=10",
        "data.batch_size=12",
        "data.eval_negatives=20",
        "data.shuffle=false",
    ]
    text = fit_run(info, [*common, "data=sequences", f"data.path={games}"])
    parquet = fit_run(info, [*common, "data=parquet_sequences", f"data.path={tmp_path / 'pq' / 'Games.parquet'}"])
    assert len(text.losses) == 8
    assert [s.tolist() for s in parquet.sample_ids] == [s.tolist() for s in text.sample_ids]
    assert parquet.losses == text.losses


def test_a_ratings_file_and_its_windowed_parquet_train_hstu_ranking_the_same_losses(info, tmp_path):
    """MovieLens ratings (half stars, ties in time, users too short for a window) under HSTU
    ranking: `data=movielens` against `recsys-data convert sequences --windows` read by
    `data=parquet_sequences`, whose window cut (and so max_seq_len, num_candidates) comes from
    the file; the user feature on, so the stored user vocabulary numbers users alike."""
    rng = np.random.default_rng(11)
    lines = ["userId,movieId,rating,timestamp"]
    for user in rng.permutation(np.arange(1, 41)) * 5:
        for _ in range(int(rng.integers(1, 30))):
            lines.append(f"{user},{int(rng.integers(1, 60)) * 7},{rng.integers(1, 11) / 2},{int(rng.integers(0, 40))}")
    ratings = tmp_path / "ratings.csv"
    ratings.write_text("\n".join(lines) + "\n")
    convert = ["convert", "sequences", str(ratings), str(tmp_path / "pq"), "--windows", "10", "--num-candidates", "3"]
    assert recsys_data([*convert, "--row-group-size", "7"]) == 0
    common = [
        "trainer=smoke",
        "trainer.max_steps=6",
        "trainer.eval_every=3",
        "trainer.eval_batches=1",
        "trainer.tensorboard=false",
        "model=hstu_small",
        "data.batch_size=8",
        "data.shuffle=false",
        "data.use_user_feature=true",
    ]
    movielens = ["data=movielens", f"data.path={ratings}", "data.max_seq_len=10", "data.num_candidates=3"]
    text = fit_run(info, [*common, *movielens])
    parquet = fit_run(info, [*common, "data=parquet_sequences", f"data.path={tmp_path / 'pq' / 'ratings.parquet'}"])
    assert len(text.losses) == 6
    assert [s.tolist() for s in parquet.sample_ids] == [s.tolist() for s in text.sample_ids]
    assert parquet.losses == text.losses
