"""`recsys-data convert`: Criteo TSV and interaction files to Parquet, the chunked pyarrow reading
behind them (line numbers across chunks, line ends) and their one-line errors (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from recsys_pipe.cli.data import main as run
from recsys_pipe.config import ConfigError
from recsys_pipe.data.in_memory.sequences import read_interactions
from recsys_pipe.data.text import files as text_files
from recsys_pipe.data.text.criteo_tsv import CATEGORICAL_KEYS, DENSE_NAMES, read_criteo
from recsys_pipe.data.text.interactions import CsvConfig

BIN = Path(sys.executable).parent


def row(label=1, ints=None, cats=None) -> str:
    ints = ints if ints is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i * 17 + 5:08x}" for i in range(26)]
    return "\t".join([str(label), *ints, *cats]) + "\n"


def _rows(n: int, seed: int = 0) -> list[str]:
    """Criteo rows with empty fields, negatives and ids of every width up to 16 digits."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ints = ["" if rng.random() < 0.2 else str(int(v)) for v in rng.integers(-3, 10**6, 13)]
        width = [8, 8, 8, 0, 1, 16, 3]
        cats = [
            f"{int(v):x}".zfill(width[(i + j) % len(width)])[-16:] for j, v in enumerate(rng.integers(0, 2**62, 26))
        ]
        cats = [c if (i + j) % 7 != 3 else "" for j, c in enumerate(cats)]
        out.append(row(int(rng.integers(0, 2)), ints, cats))
    return out


def _python_reference(lines: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    fields = [line.rstrip("\n").split("\t") for line in lines]
    labels = np.array([int(f[0]) for f in fields])
    ints = np.array([[int(v) if v else 0 for v in f[1:14]] for f in fields])
    cats = np.array([[int(v, 16) if v else 0 for v in f[14:]] for f in fields])
    return labels, ints, cats


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few hundred bytes, so that a small file spans many of them."""
    monkeypatch.setattr(text_files, "CHUNK_BYTES", 700)


def test_convert_criteo_writes_the_rows_as_parsed(tmp_path, small_chunks, capsys):
    lines = _rows(50)
    (tmp_path / "day_0").write_text("".join(lines[:30]))
    (tmp_path / "day_1.txt").write_text("".join(lines[30:]).replace("\n", "\r\n"))  # Windows line ends
    out = tmp_path / "parquet"
    code = run(
        ["convert", "criteo", str(tmp_path / "day_0"), str(tmp_path / "day_1.txt"), str(out), "--row-group-size", "8"]
    )
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["day_0.parquet", "day_1.parquet"]  # no partial file left
    labels, ints, cats = _python_reference(lines)
    tables = [pq.read_table(out / name) for name in ("day_0.parquet", "day_1.parquet")]
    assert [t.num_rows for t in tables] == [30, 20]
    assert [pq.ParquetFile(out / "day_0.parquet").metadata.row_group(i).num_rows for i in range(4)] == [8, 8, 8, 6]
    schema = tables[0].schema
    assert schema.names == ["label", *DENSE_NAMES, *CATEGORICAL_KEYS]
    assert str(schema.field("label").type) == "int8" and {str(f.type) for f in schema if f.name != "label"} == {"int64"}
    both = [np.concatenate([t.column(c).to_numpy() for t in tables]) for c in schema.names]
    assert np.array_equal(both[0], labels)
    assert np.array_equal(np.stack(both[1:14], 1), ints) and np.array_equal(np.stack(both[14:], 1), cats)
    assert '"rows": 50' in capsys.readouterr().out


def test_the_chunked_reader_splits_ranks_and_numbers_lines_across_chunks(tmp_path, small_chunks):
    lines = _rows(23, seed=1)
    path = tmp_path / "train.txt"
    path.write_text("".join(lines[:-1]) + lines[-1].rstrip("\n"))  # a last line without a line end
    labels, ints, cats = _python_reference(lines)
    parts = [read_criteo(str(path), r, 3) for r in range(3)]
    assert [len(p[2]) for p in parts] == [7, 8, 8]
    assert np.array_equal(np.concatenate([p[3] for p in parts]), np.arange(1, 24))  # 1-based lines
    assert np.array_equal(np.concatenate([p[0] for p in parts]), ints)
    assert np.array_equal(np.concatenate([p[1] for p in parts]), cats)
    assert np.array_equal(np.concatenate([p[2] for p in parts]), labels)
    assert len(read_criteo(str(path), max_rows=5)[2]) == 5
    bad = lines[:17] + [row(ints=["1", "2.5", *["0"] * 11])] + lines[17:]
    path.write_text("".join(bad).replace("\n", "\r\n"))
    with pytest.raises(ConfigError, match=rf"{path}:18: column int_1 \('2.5'\) is not an integer"):
        read_criteo(str(path), 2, 3)
    path.write_text("".join(lines[:3]).replace("\n", "\r") + row(cats=["0x1f", *["0"] * 25]))  # old Mac line ends
    assert read_criteo(str(path))[1][3, 0] == 0x1F  # refused by the fast path, read as Python reads it


@pytest.mark.parametrize(
    "content, message",
    [
        ("".join(_rows(3)) + row(label=2), "bad.txt:4: label '2' is not 0 or 1"),
        ("".join(_rows(3)) + "\n" + "".join(_rows(2)), "bad.txt:4: expected 40 tab-separated columns"),
        (row(cats=["00ab", "zz", *["0"] * 24]), "bad.txt:1: column cat_1 ('zz') is not a hexadecimal id"),
        (row(cats=["f" * 17, *["0"] * 25]), "bad.txt:1: column cat_0 ('fffffffffffffffff') is not a hexadecimal"),
        (b"\x1f\x8b\x08\x00" + bytes(range(256)), "bad.txt: a binary file, not text"),
        ("", "bad.txt: the file is empty"),
    ],
)
def test_convert_criteo_refuses_bad_input_in_one_line(tmp_path, small_chunks, content, message, capsys):
    path = tmp_path / "bad.txt"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "out"
    assert run(["convert", "criteo", str(path), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not list(out.glob("*")) and not list(out.glob(".*"))  # nothing written, no partial file


def test_convert_refuses_missing_inputs_and_existing_outputs(tmp_path, capsys):
    path = tmp_path / "day_0"
    path.write_text(row())
    assert run(["convert", "criteo", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "nope: no such file" in capsys.readouterr().err
    assert run(["convert", "criteo", str(path), str(tmp_path / "out")]) == 0
    assert run(["convert", "criteo", str(path), str(tmp_path / "out")]) == 2
    assert "day_0.parquet exists (--overwrite replaces it)" in capsys.readouterr().err
    assert run(["convert", "criteo", str(path), str(tmp_path / "out"), "--overwrite"]) == 0


RATINGS = [(7, 40, 4.0, 300), (7, 20, 5.0, 100), (3, 60, 1.0, 30), (3, 20, 3.5, 10), (7, 60, 2.0, 200)]


@pytest.mark.parametrize(
    "name, text, options",
    [
        ("ratings.dat", "".join(f"{u}::{i}::{r:g}::{t}\n" for u, i, r, t in RATINGS), []),
        (
            "ratings.csv",
            "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in RATINGS),
            [],
        ),
        ("r.csv", "user,item,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in RATINGS), []),
        ("r.csv", "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in RATINGS), []),  # no header
        (
            "r.txt",
            "".join(f"{t};x;{i};{u};{r}\n" for u, i, r, t in RATINGS),
            ["--delimiter", ";", "--columns", "timestamp,_,item,user,rating"],
        ),
    ],
)
def test_convert_sequences_from_ratings(tmp_path, name, text, options, capsys):
    path = tmp_path / name
    path.write_text(text)
    assert run(["convert", "sequences", str(path), str(tmp_path / "out"), *options]) == 0, capsys.readouterr().err
    table = pq.read_table(tmp_path / "out" / (path.stem + ".parquet"))
    assert table.column_names == ["user_id", "item_ids", "timestamps", "actions"]
    assert table.to_pydict() == {
        "user_id": [3, 7],
        "item_ids": [[20, 60], [20, 60, 40]],  # chronological
        "timestamps": [[10, 30], [100, 200, 300]],
        "actions": [[3.5, 1.0], [5.0, 2.0, 4.0]],
    }


def test_convert_sequences_from_user_item_lines_and_its_errors(tmp_path, capsys):
    path = tmp_path / "Games.txt"
    path.write_text("2 5\n1 9\n2 3\n1 9\n2 7\n")
    assert run(["convert", "sequences", str(path), str(tmp_path / "out")]) == 0
    table = pq.read_table(tmp_path / "out" / "Games.parquet")
    assert table.to_pydict() == {"user_id": [1, 2], "item_ids": [[9, 9], [5, 3, 7]]}  # file order, no timestamps
    path.write_text("1 2\n1 3\n1 four\n")  # a text id among the first lines: every id is read as text
    assert run(["convert", "sequences", str(path), str(tmp_path / "out2")]) == 0
    assert pq.read_table(tmp_path / "out2" / "Games.parquet").column("item_ids").to_pylist() == [[0, 1, 2]]
    path.write_text("1 2\n1 3\n1\n")
    assert run(["convert", "sequences", str(path), str(tmp_path / "out3")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:3: expected two fields `user item`, got '1'")


def test_csv_keys_read_headers_and_headerless_files_for_the_sources(tmp_path):
    """`data.csv.*`: a header with other names, no header, or named columns (today's refusal of a
    `user,item,rating,timestamp` header is gone); bad rows still name file and line."""
    from recsys_pipe.data import MovieLensDataConfig, RankData

    body = "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in RATINGS * 3)
    for text in ("user,item,rating,timestamp\n" + body, body):
        path = tmp_path / "r.csv"
        path.write_text(text)
        cfg = MovieLensDataConfig(path=str(path), batch_size=1, max_seq_len=4, num_candidates=1, thresholds=[3.0])
        data = RankData(cfg, 0, 1)
        assert data.spec.num_tasks == 1 and len(data.dataset) > 0
    path.write_text("a|b|c\n" + "".join(f"{u}|{i}|{t}\n" for u, i, _, t in RATINGS))
    interactions = read_interactions(path, CsvConfig(delimiter="|", columns=["user", "item", "timestamp"]))
    assert interactions.users == [3, 7] and interactions.items == [[20, 60], [20, 60, 40]]
    path.write_text("user,item,rating,timestamp\n1,2,4,100\n1,3,4\n")
    with pytest.raises(ConfigError, match=r"r.csv:3: expected 4 fields \(user, movie, rating, timestamp\), got 3"):
        read_interactions(path)


def test_the_console_script_exits_2_with_one_line(tmp_path):
    path = tmp_path / "day_0"
    path.write_text(row() + row(ints=["1", "x7", *["0"] * 11]))
    proc = subprocess.run(
        [str(BIN / "recsys-data"), "convert", "criteo", str(path), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr == f"error: {path}:2: column int_1 ('x7') is not an integer\n"


@pytest.mark.parametrize(
    "source, keys",
    [
        ("criteo", ["data.path=???", "data.num_embeddings=100000", "data.max_rows=null"]),
        (
            "movielens",
            ["data.path=???", "data.csv.delimiter=null", "data.csv.columns=null", "data.thresholds=[4.0, 5.0]"],
        ),
    ],
)
def test_help_lists_a_sources_keys_before_its_path_is_set(source, keys, capsys):
    from recsys_pipe.cli import train as train_cli

    assert train_cli.run(["--help", f"data={source}"]) == 0
    out = capsys.readouterr().out
    assert "keys not listed" not in out
    for key in keys:
        assert f"  {key} " in out, key


CLICKS = "1700000000;u17;i4;5.0\n1700000100;u17;i9;3.0\n1700000200;u17;i4;4.0\n1700000300;u17;i2;2.0\n"
CLICKS += "1700000000;u3;i9;5.0\n1700000060;u3;i2;1.0\n1700000120;u3;i7;4.5\n1700000180;u3;i4;5.0\n"


def test_text_ids_are_numbered_and_their_texts_kept(tmp_path, capsys):
    """The docs' `1700000000;u17;i4;5.0` lines: converted, and trained on as text (data.md)."""
    import json

    from recsys_pipe.data.parquet.decode import ITEM_NAMES_KEY, USER_NAMES_KEY

    (tmp_path / "clicks.txt").write_text(CLICKS)
    args = ["--delimiter", ";", "--no-header", "--columns", "timestamp,user,item,rating"]
    assert run(["convert", "sequences", str(tmp_path / "clicks.txt"), str(tmp_path / "out"), *args]) == 0
    table = pq.read_table(tmp_path / "out" / "clicks.parquet")
    names = {k: json.loads(v) for k, v in table.schema.metadata.items() if k in (ITEM_NAMES_KEY, USER_NAMES_KEY)}
    assert names == {USER_NAMES_KEY: ["u17", "u3"], ITEM_NAMES_KEY: ["i2", "i4", "i7", "i9"]}
    assert table.column("item_ids").to_pylist() == [[1, 3, 1, 0], [3, 0, 2, 1]]  # i4 i9 i4 i2 | i9 i2 i7 i4
    csv = CsvConfig(delimiter=";", header=False, columns=["timestamp", "user", "item", "rating"])
    read = read_interactions(tmp_path / "clicks.txt", csv)  # data=sequences reads the text as well
    assert read.users == ["u17", "u3"] and read.items[0] == ["i4", "i9", "i4", "i2"]


def test_ratings_on_another_scale_with_rating_scale(tmp_path, capsys):
    from recsys_pipe.data import RankData
    from recsys_pipe.data.parquet.ranking import ParquetRankingDataConfig

    lines = [f"{u}::{i}::{(u * i) % 10 + 1}::{1000 + i}" for u in range(1, 9) for i in range(1, 9)]
    (tmp_path / "ratings.dat").write_text("\n".join(lines) + "\n")
    convert = ["convert", "sequences", str(tmp_path / "ratings.dat"), str(tmp_path / "out"), "--windows", "6"]
    assert run([*convert, "--num-candidates", "2"]) == 2
    assert "rating '6' is outside (0, 5]" in capsys.readouterr().err
    assert run([*convert, "--num-candidates", "2", "--rating-scale", "10"]) == 0
    path = tmp_path / "out" / "ratings.parquet"
    cfg = ParquetRankingDataConfig(path=str(path), batch_size=4, thresholds=[8.0, 10.0])
    (batch,) = list(RankData(cfg, 0, 1, eval_batches=0).train_loader())[:1]
    ratings = [r for row in pq.read_table(path).column("actions").to_pylist()[:4] for r in row[-2:]]
    assert batch.labels.tolist() == [[float(r >= 8), float(r >= 10)] for r in ratings]  # thresholds in its scale
    actions = batch.sparse_features["action"].values().tolist()
    history = [r for row in pq.read_table(path).column("actions").to_pylist()[:4] for r in row[:-2]]
    assert [a for a in actions if a] == [round(r) for r in history]  # round(10 / 10 x rating)


def test_a_retrieval_model_on_windows_is_refused_in_one_line(tmp_path, capsys, no_process_group):
    from recsys_pipe.testing import train_here

    lines = [f"{u}::{i}::{(u * i) % 5 + 1}::{1000 + i}" for u in range(1, 9) for i in range(1, 9)]
    (tmp_path / "ratings.dat").write_text("\n".join(lines) + "\n")
    assert run(["convert", "sequences", str(tmp_path / "ratings.dat"), str(tmp_path), "--windows", "6"]) == 0
    path = tmp_path / "ratings.parquet"
    assert train_here("--check", "model=sasrec", "data=parquet_sequences", f"data.path={path}") == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        f"error: data.path: {path}: its rows are windows of ratings for HSTU ranking (recsys-pipe/windows), not one "
        "row per user: a retrieval model reads users (convert without --windows)"
    )
