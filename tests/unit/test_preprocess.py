"""`recsys_pipe.data.preprocess`, the file an export ships as `preprocess.py`: it imports only
numpy and torch, and on the same raw rows it makes exactly what the training sources make
(every row of a Criteo TSV file, of the Criteo Parquet layout and of a `data.columns` mapping
with float, integer, string, list and unknown-to-the-vocabulary ids)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys_pipe.data import preprocess
from recsys_pipe.testing import load_run


def test_it_imports_only_numpy_and_torch():
    tree = ast.parse(Path(preprocess.__file__).read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert modules <= {"__future__", "json", "collections", "pathlib", "typing", "numpy", "torch"}


def _agree(source, batch_rows: int) -> None:
    """Every row of `source` (a built data source) through the training path and through
    `preprocess.inputs` on its raw rows: the same tensors, bit for bit."""
    from recsys_pipe.models.dlrm import TabularLayout

    described = source.serving_features()
    features = described["features"]
    dense = described["inputs"]["dense_features"]
    names = [n for n in features if n not in dense]
    multi = [n for n in names if features[n]["column"] in ("tags",)]
    layout = TabularLayout(tuple(n for n in names if n not in multi), tuple(multi))
    inputs = {"dense_features": dense, "sparse_ids": list(layout.single)}
    if multi:
        inputs |= {"list_ids": multi, "list_lengths": multi}
    description = {"format": preprocess.FORMAT, "program": "tabular", "inputs": inputs, "features": features}
    seen = 0
    for batch in source:
        made = preprocess.inputs(source.raw_rows(batch.sample_ids.tolist(), None), description)
        for name, tensor in zip(inputs, layout.inputs(batch)):
            assert torch.equal(made[name], tensor), name
        seen += len(batch.sample_ids)
    assert seen == batch_rows


def test_criteo_tsv_rows_agree(tmp_path):
    from recsys_pipe.data.in_memory.criteo import CriteoDataset, collate_criteo

    lines = ["1\t5\t\t-2" + "\t7" * 10 + "\t\t0x1f" + "\t68fd1e64" * 24]
    rng = np.random.default_rng(0)
    for i in range(30):
        ints = [str(v) if v % 4 else "" for v in rng.integers(-3, 10**6, 13)]
        lines.append("\t".join([str(i % 2), *ints, *(f"{v:x}" if v % 6 else "" for v in rng.integers(0, 2**40, 26))]))
    (tmp_path / "day.tsv").write_text("\n".join(lines) + "\n")
    cfg = load_run("model=dlrm", "data=criteo", f"data.path={tmp_path / 'day.tsv'}", "data.num_embeddings=1009").data
    dataset = CriteoDataset(cfg)
    batches = [collate_criteo([dataset[i] for i in range(k, min(k + 8, len(dataset)))]) for k in range(0, 31, 8)]
    _agree(_Batches(dataset, batches), 31)


class _Batches:
    """A source's description and raw rows, with batches made by its training path."""

    def __init__(self, source, batches):
        self.source, self.batches = source, batches

    def serving_features(self):
        return self.source.serving_features()

    def raw_rows(self, ids, split):
        return self.source.raw_rows(ids, split)

    def __iter__(self):
        return iter(self.batches)


@pytest.mark.parametrize("layout", ["criteo", "columns"])
def test_parquet_rows_agree(tmp_path, layout):
    from recsys_pipe.data import RankData

    rng = np.random.default_rng(1)
    n = 40
    if layout == "criteo":
        columns = {"label": rng.integers(0, 2, n).astype(np.int8)}
        columns |= {f"int_{i}": rng.integers(-5, 10**9, n) for i in range(13)}
        columns |= {f"cat_{i}": rng.integers(0, 2**62, n) for i in range(26)}
        keys = ["data.num_embeddings=1009"]
    else:
        columns = {
            "click": rng.integers(0, 2, n),
            "price": rng.normal(0, 50, n),
            "age": rng.integers(-10, 10**6, n),
            "user_id": rng.integers(-(2**63), 2**63 - 1, n),
            "shop": pa.array(["", "é", *(f"shop-{v}" for v in rng.integers(0, 99, n - 2))]),
            "tags": pa.array([rng.integers(0, 10**6, rng.integers(0, 5)).tolist() for _ in range(n)]),
            "hour": rng.integers(0, 24, n),
        }
        keys = ["++data.columns.labels=[click]", "++data.columns.dense=[price,age]"]
        keys += ["++data.columns.dense_transform=signed_log1p"]
        extras = (("user", "column=user_id"), ("shop", "ids=hash"), ("tags", "ids=modulo"), ("hour", "ids=as_is"))
        for name, extra in extras:
            keys += [f"++data.columns.sparse.{name}.num_embeddings=97", f"++data.columns.sparse.{name}.{extra}"]
        keys[-2] = "++data.columns.sparse.hour.num_embeddings=24"
    pq.write_table(pa.table(columns), tmp_path / "x.parquet", row_group_size=16)
    run = load_run("model=dlrm", "data=parquet", f"data.path={tmp_path / 'x.parquet'}", "data.batch_size=8", *keys)
    data = RankData(run.data, 0, 1)
    _agree(_Batches(data.dataset, list(data.train_loader())), 40)


def test_ids_outside_an_as_is_table_and_unknown_items_are_named():
    record = {"column": "hour", "parse": "id", "ids": {"mapping": "as_is", "num_embeddings": 24}}
    description = {
        "format": preprocess.FORMAT,
        "program": "tabular",
        "inputs": {"dense_features": [], "sparse_ids": ["hour"]},
        "features": {"hour": record},
    }
    with pytest.raises(ValueError, match="column 'hour': id 24 outside"):
        preprocess.inputs([{"hour": 3}, {"hour": 24}], description)
    vocabulary = {"mapping": "vocabulary", "num_embeddings": 3, "values": ["a", "b", "d"]}
    assert preprocess.map_ids(["d", "c", "a"], vocabulary).tolist() == [2, -1, 0]
