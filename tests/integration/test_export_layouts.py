"""Exports of every shipped model on every data layout load and score from their saved files,
and from raw rows.

One short run per (model, layout), trained in this process (a step, a checkpoint); each is
exported without its own check, and all exports are then checked in one fresh interpreter where
recsys_pipe, torchrec and fbgemm cannot be imported (`verify_exports`, what `recsys-export`
runs before it reports success): `program.pt2` scores `example_inputs.pt` as
`expected_scores.pt` within 1e-5, `preprocess.py` turns `raw_example.jsonl` into exactly
`example_inputs.pt`, and the program scores those within 1e-5 too. The layouts: the Criteo TSV
(hexadecimal ids, empty cells), the Criteo Parquet layout, `data.columns` mappings (two labels,
integer, string and list ids, float and integer dense columns; another without dense columns),
MovieLens ratings and their Parquet windows (HSTU ranking, with the user feature), "user item"
lines and sequence Parquet with timestamps, of integer and of text ids (the retrieval models).

The training path's transforms and `preprocess.py` are also compared directly on the same raw
rows (`test_preprocess_and_training_transforms_agree`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_pipe.cli import export as export_cli
from recsys_pipe.testing import train_here
from recsys_pipe.train.export import export_run, verify_exports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEP = ["trainer=smoke", "trainer.max_steps=1", "trainer.checkpoint.interval=1", "trainer.eval_every=0"]
STEP += ["trainer.eval_batches=1", "trainer.tensorboard=false"]


def _criteo_tsv(path: Path, rows: int) -> None:
    rng = np.random.default_rng(0)
    lines = []
    for i in range(rows):
        ints = [str(v) if v % 5 else "" for v in rng.integers(-2, 500, 13)]
        cats = [f"{v:08x}" if v % 7 else "" for v in rng.integers(0, 2**32, 26)]
        lines.append("\t".join([str(i % 2), *ints, *cats]))
    path.write_text("\n".join(lines) + "\n")


def _clicks(path: Path, rows: int, dense: bool) -> None:
    rng = np.random.default_rng(1)
    columns = {
        "click": rng.integers(0, 2, rows).astype(np.int8),
        "like": rng.random(rows).astype(np.float32),
        "user_id": rng.integers(-(2**62), 2**62, rows),
        "shop": pa.array([f"shop-{v}" for v in rng.integers(0, 40, rows)]),
        "tags": pa.array(
            [rng.integers(0, 900, rng.integers(0, 4)).tolist() for _ in range(rows)], pa.list_(pa.int64())
        ),
        "hour": rng.integers(0, 24, rows),
    }
    if dense:
        columns |= {"price": rng.random(rows) * 100, "age_days": rng.integers(0, 3000, rows)}
    pq.write_table(pa.table(columns), path, row_group_size=100)


def _ratings(path: Path) -> None:
    """MovieLens ml-1m lines: 30 users, 12-20 ratings each, movies with gaps in their ids."""
    rng = np.random.default_rng(2)
    lines = []
    for user in range(1, 31):
        for k in range(12 + user % 9):
            lines.append(f"{user * 3}::{int(rng.integers(1, 60)) * 7}::{int(rng.integers(1, 6))}::{10**9 + k * 3600}")
    path.write_text("\n".join(lines) + "\n")


def _text_ids(source: Path, path: Path) -> None:
    """The ratings with text ids (`u3`, `m21`), as the Amazon data sets have them."""
    lines = []
    for line in source.read_text().splitlines():
        user, movie, rating, stamp = line.split("::")
        lines.append(f"u{user}::m{movie}::{rating}::{stamp}")
    path.write_text("\n".join(lines) + "\n")


def _user_items(path: Path) -> None:
    lines = [f"{u} {(u * 7 + k) % 30 + 100}" for u in range(1, 41) for k in range(3 + u % 10)]
    path.write_text("\n".join(lines) + "\n")


def _train(tmp: Path, name: str, *overrides: str) -> Path:
    out = tmp / "runs" / name
    assert train_here(*STEP, *overrides, f"trainer.output_dir={out}") == 0, name
    (run_dir,) = (out / "recsys-train").iterdir()
    return run_dir


def _layouts(tmp: Path) -> dict[str, list[str]]:
    """The (model, data) overrides of each case, with the files they read written into `tmp`."""
    from recsys_pipe.data.text.interactions import CsvConfig
    from recsys_pipe.data.tools.convert import convert_criteo, convert_sequences

    _criteo_tsv(tmp / "day.tsv", 48)
    (criteo,) = convert_criteo([str(tmp / "day.tsv")], str(tmp / "criteo"))
    _clicks(tmp / "clicks.parquet", 48, dense=True)
    _clicks(tmp / "plain.parquet", 48, dense=False)
    _ratings(tmp / "ratings.dat")
    windows = convert_sequences(str(tmp / "ratings.dat"), str(tmp / "windows"), windows=8, num_candidates=2)
    sequences = convert_sequences(str(tmp / "ratings.dat"), str(tmp / "sequences"))
    _text_ids(tmp / "ratings.dat", tmp / "text_ids.dat")
    columns = CsvConfig(delimiter="::", header=False, columns=["user", "item", "rating", "timestamp"])
    text_ids = convert_sequences(str(tmp / "text_ids.dat"), str(tmp / "text_ids"), csv=columns)
    _user_items(tmp / "seq.txt")
    small = ["data.batch_size=8"]
    mapped = ["data=parquet", "data.columns.labels=[click,like]", "data.columns.sparse.user.column=user_id"]
    mapped += ["data.columns.sparse.user.num_embeddings=50", "data.columns.sparse.shop.num_embeddings=20"]
    sparse = mapped + ["data.columns.sparse.hour.num_embeddings=24", "data.columns.sparse.hour.ids=as_is"]
    ranking = [
        "model=hstu_small",
        "data.max_seq_len=8",
        "data.num_candidates=2",
        "data.use_user_feature=true",
        "data.batch_size=8",
    ]
    retrieval = ["data.max_seq_len=6", "model.max_seq_len=8", "data.eval_negatives=5", "data.batch_size=4"]
    return {
        "dlrm-criteo_tsv": [
            "model=dlrm",
            "data=criteo",
            f"data.path={tmp / 'day.tsv'}",
            "data.num_embeddings=97",
            *small,
        ],
        "dlrm_dcn-criteo_parquet": ["model=dlrm_dcn", "data=parquet", f"data.path={criteo.path}", *small],
        "dlrm-columns": [
            "model=dlrm",
            *sparse,
            f"data.path={tmp / 'clicks.parquet'}",
            "data.columns.dense=[price,age_days]",
            "data.columns.dense_transform=signed_log1p",
            "data.columns.sparse.tags.num_embeddings=30",
            "data.columns.sparse.tags.ids=modulo",
            *small,
        ],
        "dlrm_torch-columns_no_dense": ["model=dlrm_torch", *sparse, f"data.path={tmp / 'plain.parquet'}", *small],
        "hstu-movielens": [*ranking, "data=movielens", f"data.path={tmp / 'ratings.dat'}"],
        "hstu-parquet_windows": [*ranking, "data=parquet_sequences", f"data.path={windows.path}"],
        "sasrec-parquet_text_ids": ["model=sasrec", "data=parquet_sequences", f"data.path={text_ids.path}"] + retrieval,
        "hstu_retrieval-user_items": ["model=hstu_retrieval", "data=sequences", f"data.path={tmp / 'seq.txt'}"]
        + retrieval,
        "hstu_retrieval-parquet_sequences": [
            "model=hstu_retrieval",
            "data=parquet_sequences",
            f"data.path={sequences.path}",
            *retrieval,
        ],
    }


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """Every case trained and exported (unchecked: `verify_exports` checks them all at once)."""
    tmp = tmp_path_factory.mktemp("layouts")
    outs = {}
    for name, overrides in _layouts(tmp).items():
        run_dir = _train(tmp, name, *overrides)
        outs[name] = export_run(run_dir, tmp / "exports" / name, verify=False).out
    return outs


def test_every_export_scores_from_its_saved_files_and_raw_rows(exports):
    records = {Path(r["out"]).name: r for r in verify_exports(list(exports.values()))}
    assert set(records) == set(exports)
    for name, record in records.items():
        assert record["loaded"] == [], name
        assert record["program_diff"] <= 1e-5, (name, record)
        assert record["inputs_match"], (name, record)
        assert record["raw_diff"] <= 1e-5, (name, record)


def test_features_json_describes_each_transform(exports):
    mapped = json.loads((exports["dlrm-columns"] / "features.json").read_text())
    assert mapped["program"] == "tabular"
    assert mapped["inputs"]["dense_features"] == ["price", "age_days"]
    assert mapped["inputs"]["sparse_ids"] == ["user", "shop", "hour"] and mapped["inputs"]["list_ids"] == ["tags"]
    hashed = mapped["features"]["shop"]["ids"]
    assert hashed == {
        "mapping": "hash",
        "num_embeddings": 20,
        "function": "splitmix64",
        "seed": 0,
        "strings": "fnv1a64",
    }
    assert mapped["features"]["price"]["transform"] == {"kind": "signed_log1p"}
    assert mapped["features"]["tags"]["ids"] == {"mapping": "modulo", "num_embeddings": 30}
    rows = [json.loads(line) for line in (exports["dlrm-columns"] / "raw_example.jsonl").read_text().splitlines()]
    assert isinstance(rows[0]["shop"], str) and isinstance(rows[0]["tags"], list)
    tsv = json.loads((exports["dlrm-criteo_tsv"] / "features.json").read_text())
    assert tsv["features"]["cat_0"] == {
        "column": "cat_0",
        "parse": "hex",
        "missing": 0,
        "ids": {"mapping": "modulo", "num_embeddings": 97},
    }
    texts = json.loads((exports["sasrec-parquet_text_ids"] / "features.json").read_text())
    assert texts["features"]["item"]["ids"]["values"][:2] == ["m105", "m112"]  # the texts, sorted
    first = json.loads((exports["sasrec-parquet_text_ids"] / "raw_example.jsonl").read_text().splitlines()[0])
    assert first["user_id"].startswith("u") and all(i.startswith("m") for i in first["item_ids"])
    ranking = json.loads((exports["hstu-movielens"] / "features.json").read_text())
    assert ranking["features"]["action"]["transform"] == {"kind": "scaled_round", "scale": 2.0}
    assert ranking["features"]["item"]["ids"]["mapping"] == "vocabulary"
    assert ranking["params"] == {
        "history": 8,
        "num_candidates": 2,
        "candidates_column": "num_candidates",
        "max_seq_len": 32,
    }


def test_retrieval_preprocess_maps_raw_items_to_rows_and_back(exports):
    import importlib.util

    import torch

    out = exports["hstu_retrieval-parquet_sequences"]
    spec = importlib.util.spec_from_file_location("preprocess_under_test", out / "preprocess.py")
    preprocess = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preprocess)
    features = preprocess.load_features(out / "features.json")
    vocabulary = features["features"]["item"]["ids"]["values"]
    rows = preprocess.item_rows([vocabulary[3], vocabulary[0], -5], features)
    assert rows.tolist() == [3, 0, -1]  # -1: an item the model has no vector for
    assert preprocess.item_ids(np.array([[3, 0]]), features).tolist() == [[vocabulary[3], vocabulary[0]]]
    table = torch.load(out / "item_table.pt")
    assert table.shape[0] == len(vocabulary)


def test_the_cli_verifies_and_refuses_a_used_output(exports, tmp_path, capsys):
    """`recsys-export` checks the saved files before it reports success; OUT that is a file or a
    directory with something in it is refused in one line (exit 2) unless --overwrite, which
    replaces it whole."""
    run_dir = next((exports["dlrm-columns"].parent.parent / "runs" / "dlrm-columns" / "recsys-train").iterdir())
    out = tmp_path / "served"
    out.mkdir()
    (out / "stale.pt").write_text("from an earlier export")
    assert export_cli.run([str(run_dir), str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"error: OUT: {out} is not empty (--overwrite replaces it whole: nothing of it is kept)"
    assert (out / "stale.pt").is_file()
    assert export_cli.run([str(run_dir), str(out / "stale.pt")]) == 2
    assert capsys.readouterr().err.splitlines()[0] == f"error: OUT: {out / 'stale.pt'} is a file, not a directory"
    assert export_cli.run([str(run_dir), str(out), "--overwrite"]) == 0
    assert "exported the ranking model" in capsys.readouterr().out
    assert not (out / "stale.pt").exists() and (out / "program.pt2").is_file()
    # exactly the documented files: the saved-file check leaves no __pycache__ of preprocess.py
    assert sorted(p.name for p in out.iterdir()) == [
        "example_inputs.pt",
        "expected_scores.pt",
        "features.json",
        "preprocess.py",
        "program.pt2",
        "raw_example.jsonl",
        "serving.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]  # nothing left beside it
