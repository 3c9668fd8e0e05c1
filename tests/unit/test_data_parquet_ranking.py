"""`data=parquet_sequences` for HSTU ranking (`recsys_pipe.data.parquet.ranking`): the model picks
what the source serves, windowed Parquet gives `data=movielens`' batches, shuffles and resumes by
position with workers, and bad files are refused in one line naming file, row group and column.
(Training losses against `data=movielens`: tests/unit/test_data_file_vs_parquet.py.)"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys_pipe.cli.data import main as recsys_data
from recsys_pipe.config import ConfigError
from recsys_pipe.data.batch import MASKED_ACTION
from recsys_pipe.data.in_memory.movielens import MovieLensDataConfig
from recsys_pipe.data.parquet import sequences as parquet_sequences
from recsys_pipe.data.parquet.files import DataFileError
from recsys_pipe.data.parquet.ranking import ParquetRankingDataConfig
from recsys_pipe.data.parquet.sequences import ParquetSequencesDataConfig
from recsys_pipe.data.source import RankData, SequenceDataConfig
from recsys_pipe.testing import load_run


@pytest.fixture(scope="module")
def ratings(tmp_path_factory):
    """A ratings CSV (half stars, ties in time, users too short for a window) and its
    `convert sequences --windows 10 --num-candidates 3` Parquet (row groups of 9 windows)."""
    d = tmp_path_factory.mktemp("ratings")
    rng = np.random.default_rng(4)
    lines = ["userId,movieId,rating,timestamp"]
    for user in rng.permutation(np.arange(1, 51)) * 3:
        for _ in range(int(rng.integers(1, 36))):
            lines.append(f"{user},{int(rng.integers(1, 70)) * 5},{rng.integers(1, 11) / 2},{int(rng.integers(0, 60))}")
    (d / "ratings.csv").write_text("\n".join(lines) + "\n")
    argv = ["convert", "sequences", str(d / "ratings.csv"), str(d / "pq"), "--windows", "10", "--num-candidates", "3"]
    assert recsys_data([*argv, "--row-group-size", "9"]) == 0
    return str(d / "ratings.csv"), str(d / "pq" / "ratings.parquet")


def ranking(path, **kw) -> ParquetRankingDataConfig:
    """`data=parquet_sequences` as HSTU ranking gets it."""
    return ParquetSequencesDataConfig(path=path, **kw).as_kind(SequenceDataConfig)  # type: ignore[return-value]


def test_the_model_decides_what_parquet_sequences_serves(ratings):
    _, path = ratings
    hstu = load_run("model=hstu_small", "data=parquet_sequences", f"data.path={path}").data
    assert type(hstu) is ParquetRankingDataConfig
    assert (hstu.max_seq_len, hstu.num_candidates) == (10, 3)  # the file's recorded cut
    sasrec = load_run("model=sasrec", "data=parquet_sequences", f"data.path={path}").data
    assert type(sasrec) is ParquetSequencesDataConfig and sasrec.max_seq_len == 50
    with pytest.raises(ConfigError, match="data.name: model 'dlrm' needs tabular data"):
        load_run("model=dlrm", "data=parquet_sequences", f"data.path={path}")
    with pytest.raises(ConfigError, match=r"data.max_seq_len: 10 exceeds model.max_seq_len \(8\)"):
        load_run("model=hstu_small", "model.max_seq_len=8", "data=parquet_sequences", f"data.path={path}")


@pytest.mark.parametrize("part", [16, None])
def test_windowed_parquet_gives_the_batches_of_data_movielens(ratings, part, monkeypatch):
    """Whole windows, and windows handed out in parts of 16 rows (`PartedStreamSource`)."""
    if part is not None:
        monkeypatch.setattr(parquet_sequences, "_PART_ROWS", part)
    csv, path = ratings
    kw = {"batch_size": 8, "shuffle": False, "use_user_feature": True, "thresholds": [3.5]}
    ref = RankData(MovieLensDataConfig(path=csv, max_seq_len=10, num_candidates=3, **kw), 0, 1, eval_batches=2)
    got = RankData(ranking(path, **kw), 0, 1, eval_batches=2)
    assert (got.batches_per_epoch, got.spec) == (ref.batches_per_epoch, ref.spec)
    pairs = [*zip(ref.train_loader(), got.train_loader(), strict=True)]
    pairs += [*zip(ref.eval_loader(), got.eval_loader(), strict=True)]
    assert len(pairs) > 10
    for a, b in pairs:
        assert a.sparse_features.keys() == b.sparse_features.keys()
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
        assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
        for name in ("timestamps", "num_candidates", "labels", "sample_ids"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name


def test_windows_shuffle_once_per_epoch_and_resume_by_position_with_workers(ratings, monkeypatch):
    monkeypatch.setattr(parquet_sequences, "_PART_ROWS", 12)  # windows of 36 rows in parts of 12
    _, path = ratings
    cfg = ranking(path, batch_size=6, shuffle=True, shuffle_window=36, num_workers=2)
    data = RankData(cfg, 1, 2)
    full = list(data.train_loader(2))
    per_epoch = data.batches_per_epoch
    assert len(full) == 2 * per_epoch
    epochs = [torch.cat([b.sample_ids for b in full[e * per_epoch : (e + 1) * per_epoch]]) for e in range(2)]
    assert all(len(set(ids.tolist())) == len(ids) for ids in epochs)  # no window twice in an epoch
    assert not torch.equal(epochs[0], epochs[1])  # shuffled again
    resumed = list(RankData(cfg, 1, 2).train_loader(2, per_epoch - 2))
    for a, b in zip(full[per_epoch - 2 :], resumed, strict=True):
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
        assert torch.equal(a.labels, b.labels) and torch.equal(a.sample_ids, b.sample_ids)


def _samples(batches) -> dict[int, tuple]:
    """Each sample of `batches` by its id: items, actions, timestamps and labels."""
    out = {}
    for b in batches:
        kjt, c = b.sparse_features, b.num_candidates.tolist()
        lengths = b.item_lengths().tolist()
        items = kjt["item"].values().split(lengths)
        actions = kjt["action"].values().split(lengths)
        stamps = b.timestamps.split(lengths)
        labels = b.labels.split(c)
        for k, sid in enumerate(b.sample_ids.tolist()):
            out[sid] = (items[k].tolist(), actions[k].tolist(), stamps[k].tolist(), labels[k].tolist())
    return out


def test_a_shuffled_window_in_parts_holds_the_same_samples(ratings, monkeypatch):
    """Shuffled rows decoded in parts of a window (rows gathered by the permutation) are the
    same samples as unshuffled ones, sample id by sample id."""
    monkeypatch.setattr(parquet_sequences, "_PART_ROWS", 8)
    _, path = ratings
    plain = _samples(RankData(ranking(path, batch_size=4, shuffle=False, num_workers=0), 0, 1).train_loader())
    cfg = ranking(path, batch_size=4, shuffle=True, shuffle_window=40, use_user_feature=True)
    shuffled = _samples(RankData(cfg, 0, 1).train_loader())
    common = sorted(plain.keys() & shuffled.keys())
    assert len(common) > 0.9 * len(plain) and list(shuffled) != sorted(shuffled)
    assert all(shuffled[sid] == plain[sid] for sid in common)


def test_a_row_per_user_trains_its_most_recent_window(tmp_path):
    """Rows not cut by the converter: each row is one sample, its last max_seq_len events."""
    t = pa.table(
        {
            "user_id": [7, 9],
            "item_ids": pa.array([[0, 1, 2, 3, 4, 5, 6], [8, 7, 6]], pa.list_(pa.int64())),
            "actions": pa.array([[1.0, 1.5, 2.0, 2.5, 3.0, 4.5, 3.5], [5.0, 4.0, 2.0]], pa.list_(pa.float64())),
        }
    )
    pq.write_table(t, tmp_path / "users.parquet")
    cfg = ranking(str(tmp_path / "users.parquet"), max_seq_len=5, num_candidates=2, batch_size=2, num_items=9)
    (batch,) = RankData(cfg, 0, 1).train_loader()
    kjt = batch.sparse_features
    assert kjt["item"].values().tolist() == [2, 3, 4, 5, 6, 8, 7, 6]
    assert kjt["action"].values().tolist() == [4, 5, 6, MASKED_ACTION, MASKED_ACTION, 10, MASKED_ACTION, MASKED_ACTION]
    assert batch.timestamps.tolist() == [2, 3, 4, 5, 6, 0, 1, 2]  # positions stand in for time
    assert batch.labels.tolist() == [[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]]  # ratings 4.5, 3.5 | 4.0, 2.0
    assert batch.num_candidates.tolist() == [2, 2]


def _table(n: int = 20, length: int = 6, **replace) -> pa.Table:
    rng = np.random.default_rng(0)
    cols = {
        "user_id": pa.array(np.arange(n), pa.int64()),
        "item_ids": pa.array([list(rng.integers(0, 30, length)) for _ in range(n)], pa.list_(pa.int64())),
        "actions": pa.array([list(rng.integers(1, 11, length) / 2) for _ in range(n)], pa.list_(pa.float64())),
    }
    cols.update(replace)
    return pa.table(cols)


def _write(tmp_path, name: str, table: pa.Table, **write) -> str:
    pq.write_table(table, tmp_path / name, row_group_size=10, **write)
    return str(tmp_path / name)


def _data(path: str, **kw) -> RankData:
    keys = {"max_seq_len": 8, "num_candidates": 2, "batch_size": 5, "num_items": 30, **kw}
    return RankData(ranking(path, **keys), 0, 1)


def _refused_at_start(path: str, message: str, **kw) -> None:
    with pytest.raises(ConfigError) as info:
        _data(path, **kw)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def _refused_when_decoded(path: str, message: str, **kw) -> None:
    data = _data(path, **kw)
    with pytest.raises(DataFileError) as info:
        list(data.train_loader())
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_bad_rating_columns_are_refused_in_one_line_naming_file_row_group_and_column(tmp_path, monkeypatch):
    monkeypatch.setattr(parquet_sequences, "_PART_ROWS", 5)  # the bad row's part is not the window's first
    good = _table()
    _refused_at_start(
        _write(tmp_path, "none.parquet", good.drop_columns(["actions"])),
        "none.parquet: no column 'actions' (data.columns.actions names it",
    )
    strings = good.set_column(2, "actions", pa.array([["a"] * 6] * 20, pa.list_(pa.string())))
    _refused_at_start(
        _write(tmp_path, "str.parquet", strings), "str.parquet, column 'actions': must be a list of numbers"
    )
    high = [[3.0] * 6] * 10 + [[3.0] * 5 + [5.5]] + [[3.0] * 6] * 9
    big = good.set_column(2, "actions", pa.array(high, pa.list_(pa.float64())))
    message = "column 'actions': rating 5.5 gives the action id round(2 * rating) outside [0, 10]"
    _refused_at_start(_write(tmp_path, "big.parquet", big), f"big.parquet, row group 1, {message}")  # statistics
    nostats = _write(tmp_path, "big_nostats.parquet", big, write_statistics=False)
    _refused_when_decoded(nostats, f"row 10 (row group 1), {message}")
    nulls = good.set_column(
        2, "actions", pa.array([[1.0] * 6] * 13 + [[1.0, None, 2.0, 2.0, 2.0, 2.0]] * 7, pa.list_(pa.float64()))
    )
    _refused_when_decoded(
        _write(tmp_path, "null.parquet", nulls), "null.parquet, row 13 (row group 1), column 'actions': a null rating"
    )
    ragged = good.set_column(2, "actions", pa.array([[1.0] * 6] * 15 + [[1.0] * 5] * 5, pa.list_(pa.float64())))
    _refused_when_decoded(
        _write(tmp_path, "ragged.parquet", ragged),
        "ragged.parquet, row 15 (row group 1), column 'actions': lists of other lengths than 'item_ids'",
    )
    lists = good.to_pydict()
    lists["item_ids"][3], lists["actions"][3] = [1, 2], [1.0, 2.0]
    short = pa.table(lists, schema=good.schema)
    _refused_when_decoded(
        _write(tmp_path, "short.parquet", short),
        "short.parquet, row 3 (row group 0), column 'item_ids': a row of 2 event(s): a sample needs more than "
        "data.num_candidates=2",
    )
    plain = _write(tmp_path, "plain.parquet", good)
    _refused_at_start(plain, "data.use_user_feature needs a user vocabulary", use_user_feature=True)
    with pytest.raises(ConfigError, match="data.max_seq_len: HSTU ranking needs it: the files record no window cut"):
        ranking(plain, num_candidates=2)
    with pytest.raises(ConfigError, match="data.columns.actions: HSTU ranking needs the rating list column"):
        _data(plain, columns={"actions": None})


def test_another_window_cut_than_the_files_is_refused(ratings):
    _, path = ratings
    with pytest.raises(ConfigError) as info:
        RankData(ranking(path, max_seq_len=12), 0, 1)
    assert str(info.value).startswith("data.max_seq_len: ") and "holds windows cut with max_seq_len=10" in str(
        info.value
    )


def test_convert_windows_needs_ratings_and_fewer_candidates_than_the_window(tmp_path, capsys):
    games = tmp_path / "Games.txt"
    games.write_text("1 5\n1 6\n1 7\n2 5\n")
    assert recsys_data(["convert", "sequences", str(games), str(tmp_path / "a"), "--windows", "6"]) == 2
    assert "--windows (HSTU ranking) needs a rating per event" in capsys.readouterr().err
    argv = ["convert", "sequences", str(games), str(tmp_path / "b"), "--windows", "4", "--num-candidates", "4"]
    assert recsys_data(argv) == 2
    assert "need 0 < --num-candidates (4) < --windows (4)" in capsys.readouterr().err


def test_inspect_shows_the_window_cut(ratings, capsys):
    _, path = ratings
    assert recsys_data(["inspect", path, "--world-size", "2", "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "actions: list<element: double>" in out
    assert 'recsys-pipe/windows: {"max_seq_len": 10, "num_candidates": 3}' in out
    assert "recsys-pipe/items:" not in out  # binary vocabularies are named, not shown


def test_every_missing_key_and_column_of_ones_own_file_is_named_in_one_run(tmp_path, capsys, no_process_group):
    """A user's own HSTU Parquet (other column names, no window cut, no vocabulary): one --check
    names all that is missing, each once, and exits 2."""
    from recsys_pipe.testing import train_here

    lists = {"movies": [[1, 2, 3, 4]] * 3, "stars": [[1.0, 2.0, 3.0, 4.0]] * 3}
    table = pa.table({"uid": [1, 2, 3], **{k: pa.array(v) for k, v in lists.items()}})
    pq.write_table(table, tmp_path / "own.parquet")
    assert train_here("--check", "model=hstu_small", "data=parquet_sequences", f"data.path={tmp_path}") == 2
    lines = capsys.readouterr().err.splitlines()
    named = ("data.max_seq_len:", "data.num_candidates:", "no column 'user_id'", "no column 'item_ids'")
    named += ("no item vocabulary", "no column 'actions'")
    assert [sum(n in line for line in lines) for n in named] == [1] * len(named)
    assert lines[-1].startswith("recsys-train: 6 config errors, nothing was started")


# -- data.ids=managed: raw item and user ids for managed-collision tables (docs/raw-ids.md) ---------


def test_managed_ids_pass_the_files_raw_ids_on(ratings):
    """The converted file's raw ids reach the batch as they are (the ids the vocabulary run numbers
    densely), into tables of the stored vocabularies' sizes or data.item_rows / data.user_rows."""
    _, path = ratings
    kw = {"batch_size": 8, "shuffle": False, "use_user_feature": True}
    dense = RankData(ranking(path, **kw), 0, 1, eval_batches=1)
    raw = RankData(ranking(path, ids="managed", item_rows=24, **kw), 0, 1, eval_batches=1)
    pq_file = pq.ParquetFile(path)
    meta = pq_file.schema_arrow.metadata
    items = np.frombuffer(meta[b"recsys-pipe/items"], "<i8")
    users = np.frombuffer(meta[b"recsys-pipe/users"], "<i8")
    assert raw.spec.vocab_sizes == {**dense.spec.vocab_sizes, "item": 24}  # users: as many as the vocabulary
    assert {f: m.rows_key for f, m in raw.spec.managed.items()} == {"item": "data.item_rows", "user": "data.user_rows"}
    for a, b in zip(dense.train_loader(), raw.train_loader(), strict=True):
        x, y = a.sparse_features, b.sparse_features
        assert y["item"].values().tolist() == items[x["item"].values().numpy()].tolist()
        assert y["user"].values().tolist() == users[x["user"].values().numpy()].tolist()
        assert torch.equal(x["action"].values(), y["action"].values()) and torch.equal(a.labels, b.labels)


def test_managed_text_ids_are_hashed_as_the_tabular_sources_hash_strings(tmp_path):
    """Text ids a converter numbered: the raw id of each is FNV-1a of its text into the space."""
    from recsys_pipe.data.ids import managed_string_ids

    lines = "".join(f"{1000 + 60 * e};u{u};i{(u * 7 + e * 3) % 11};{1 + e % 5}.0\n" for u in range(6) for e in range(9))
    (tmp_path / "clicks.txt").write_text(lines)
    args = ["--delimiter", ";", "--no-header", "--columns", "timestamp,user,item,rating", "--windows", "6"]
    assert recsys_data(["convert", "sequences", str(tmp_path / "clicks.txt"), str(tmp_path / "out"), *args]) == 0
    path = str(tmp_path / "out" / "clicks.parquet")
    kw = {"batch_size": 4, "shuffle": False, "use_user_feature": True, "ids": "managed"}
    data = RankData(ranking(path, managed={"input_hash_size": 1000}, **kw), 0, 1)
    batch = next(iter(data.train_loader()))
    table = pq.read_table(path)
    names = {k: json.loads(table.schema.metadata[f"recsys-pipe/{k}-names".encode()]) for k in ("item", "user")}
    hashed = {k: managed_string_ids(pa.array(v), 1000) for k, v in names.items()}
    first = table.slice(0, 4)
    windows = [row[-6:] for row in first.column("item_ids").to_pylist()]
    assert batch.sparse_features["item"].values().tolist() == [int(hashed["item"][i]) for w in windows for i in w]
    assert batch.sparse_features["user"].values().tolist() == hashed["user"][first.column("user_id")].tolist()


def test_managed_raw_ids_outside_the_space_are_refused_in_one_line(tmp_path, capsys, no_process_group):
    """Before the start where the statistics show it (`recsys-train --check`: exit 2), else at the
    row; and a table with no size."""
    from recsys_pipe.cli import train as train_cli

    items = [[e % 20 for e in range(row, row + 6)] for row in range(20)]
    items[12][3] = 27  # row group 1 (rows 10..19)
    good = _table(item_ids=pa.array(items, pa.list_(pa.int64())))  # users 0..19
    managed = {"ids": "managed", "managed": {"input_hash_size": 25}, "item_rows": 8}
    message = "column 'item_ids': item: raw id 27 is outside [0, input_hash_size=25) with ids=managed"
    path = _write(tmp_path, "items.parquet", good)
    _refused_at_start(path, f"items.parquet, row group 1, {message}", **managed)
    argv = ["--check", "model=hstu_small", "data=parquet_sequences", f"data.path={path}", "data.max_seq_len=8"]
    argv += ["data.num_candidates=2", "data.ids=managed", "data.managed.input_hash_size=25", "data.item_rows=8"]
    assert train_cli.run(argv) == 2
    (line, *_) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: data.path: {path}, row group 1, {message}"), line
    nostats = _write(tmp_path, "items_nostats.parquet", good, write_statistics=False)
    _refused_when_decoded(nostats, f"items_nostats.parquet, row 12 (row group 1), {message}", **managed)
    users = good.set_column(0, "user_id", pa.array(np.arange(20) + 20, pa.int64()))
    small = {**managed, "managed": {"input_hash_size": 30}, "use_user_feature": True, "user_rows": 4}
    user_message = "column 'user_id': user: raw id 30 is outside [0, input_hash_size=30)"
    _refused_at_start(_write(tmp_path, "users.parquet", users), f"row group 1, {user_message}", **small)
    _refused_at_start(
        path, "data.item_rows: data.ids=managed needs the item table's rows", ids="managed", num_items=None
    )
    _refused_at_start(
        path, "data.user_rows: data.ids=managed with data.use_user_feature needs", ids="managed", use_user_feature=True
    )
