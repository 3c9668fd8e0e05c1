"""Criteo-format data: TSV parsing with file:line errors, hashing, rank split, the generated source,
and the batch (KJT layout, selection)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recsys_pipe.config import ConfigError
from recsys_pipe.data import CriteoBatch, CriteoDataConfig, CriteoSyntheticDataConfig, make_dataloader, read_criteo
from recsys_pipe.data.in_memory.criteo import CATEGORICAL_KEYS, NUM_CATEGORICAL, transform_dense
from recsys_pipe.testing import fork_ranks

BIN = Path(sys.executable).parent


def row(label=1, ints=None, cats=None) -> str:
    ints = ints if ints is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i * 17 + 5:08x}" for i in range(26)]
    return "\t".join([str(label), *ints, *cats]) + "\n"


def write(tmp_path: Path, lines: list[str], name: str = "train.txt") -> str:
    path = tmp_path / name
    path.write_text("".join(lines))
    return str(path)


def test_rows_are_parsed_hashed_and_split_over_ranks(tmp_path):
    ints = ["", "-2", *[str(i) for i in range(11)]]  # empty -> 0; Criteo has small negatives
    cats = ["", "ffffffff", *[f"{i:08x}" for i in range(24)]]
    path = write(tmp_path, [row(1, ints, cats), row(0), row(1), row(0), row(1)])
    dense, ids, labels, lines = read_criteo(path)
    assert dense[0, :3].tolist() == [0, -2, 0] and ids[0, :2].tolist() == [0, 0xFFFFFFFF]
    assert labels.tolist() == [1, 0, 1, 0, 1] and lines.tolist() == [1, 2, 3, 4, 5]
    cfg = CriteoDataConfig(path=path, num_embeddings=1000)
    parts = [make_dataloader(cfg.model_copy(update={"batch_size": 1}), r, 2).dataset for r in range(2)]
    assert [len(p) for p in parts] == [2, 3]  # contiguous shares, one row apart at most
    assert [int(p[i][3]) for p in parts for i in range(len(p))] == [0, 1, 2, 3, 4]  # row = line - 1
    first_dense, first_ids, label, _ = parts[0][0]
    assert np.allclose(first_dense, transform_dense(np.array([0, -2, *range(11)])))
    assert first_ids[1] == 0xFFFFFFFF % 1000 and label == 1.0
    assert np.sign(first_dense[1]) == -1  # sign kept
    assert len(CriteoDataConfig(path=path, max_rows=2).dataset(0, 1)) == 2


@pytest.mark.parametrize(
    "bad, message",
    [
        (row().replace("\t", "", 1)[:-1] + "\n", "expected 40 tab-separated columns"),
        ("\t".join(row().split("\t")[1:]), "found 39 (an unlabelled file such as Kaggle's test.txt"),
        (row(label=2), "label '2' is not 0 or 1"),
        (row(ints=["1", "x7", *["0"] * 11]), "column int_1 ('x7') is not an integer"),
        (row(cats=["00ab", "zz", *["0"] * 24]), "column cat_1 ('zz') is not a hexadecimal id"),
        (row(ints=["9" * 20, *["0"] * 12]), f"column int_0 ({'9' * 20}) is outside the 64-bit range"),
        (row(cats=["-1f", *["0"] * 25]), "column cat_0 ('-1f') is not a hexadecimal id in [0, 2^63)"),
        (row(cats=["f" * 17, *["0"] * 25]), "is not a hexadecimal id in [0, 2^63)"),
    ],
)
def test_a_malformed_row_names_file_and_line(tmp_path, bad, message):
    path = write(tmp_path, [row(), row(), bad, row()])
    with pytest.raises(ConfigError) as info:
        CriteoDataConfig(path=path).dataset(0, 1)
    (problem,) = info.value.problems
    assert problem.path == "data.path" and problem.message.startswith(f"{path}:3: ")
    assert message in problem.message
    # each rank parses only its own rows: line 3 is rank 1's of 2, and keeps its number there
    assert len(CriteoDataConfig(path=path).dataset(0, 2)) == 2
    with pytest.raises(ConfigError, match=f"{path}:3: "):
        CriteoDataConfig(path=path).dataset(1, 2)


def test_bucket_counts_one_or_per_feature():
    assert CriteoSyntheticDataConfig(num_embeddings=7).spec().vocab_sizes == dict.fromkeys(CATEGORICAL_KEYS, 7)
    sizes = list(range(1, NUM_CATEGORICAL + 1))
    spec = CriteoSyntheticDataConfig(num_embeddings=sizes).spec()
    assert list(spec.vocab_sizes.values()) == sizes and spec.num_dense == 13 and spec.num_tasks == 1
    with pytest.raises(ValueError, match="list 26 bucket counts"):
        CriteoSyntheticDataConfig(num_embeddings=[5, 5])


def _synthetic(**kw) -> CriteoSyntheticDataConfig:
    return CriteoSyntheticDataConfig(**{"batch_size": 8, "num_embeddings": 50, **kw})


def test_generated_rows_are_seeded_disjoint_and_independent_of_rank_count():
    whole = _synthetic().dataset(0, 1)
    halves = [_synthetic().dataset(r, 2) for r in range(2)]
    for r, half in enumerate(halves):
        for i in range(5):
            a, b = half[i], whole[2 * i + r]
            assert a[3] == b[3] and np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
    other = _synthetic(seed=1).dataset(0, 1)[0]
    assert not np.array_equal(other[1], whole[0][1])
    ids = np.stack([whole[i][1] for i in range(2000)])
    assert ids.min() >= 0 and ids.max() < 50
    counts = np.bincount(ids[:, 0], minlength=50)
    assert counts[0] > 4 * counts[25]  # popular ids are popular (Zipf)
    clicks = np.mean([whole[i][2] for i in range(2000)])
    assert 0.1 < clicks < 0.6


def test_criteo_batch_kjt_is_key_major_one_id_per_sample():
    batch = next(iter(make_dataloader(_synthetic())))
    kjt = batch.sparse_features
    assert kjt.keys() == list(CATEGORICAL_KEYS) and torch.equal(kjt.lengths(), torch.ones(8 * 26, dtype=torch.int32))
    for f, key in enumerate(CATEGORICAL_KEYS[:3]):
        assert torch.equal(kjt[key].values(), batch.sparse_ids[:, f])
    assert batch.dense_features.shape == (8, 13) and batch.labels.shape == (8, 1)
    assert int(batch.num_loss_tokens()) == 8
    picked = batch.select(torch.tensor([3, 1]))
    assert picked.sample_ids.tolist() == batch.sample_ids[[3, 1]].tolist()
    joined = CriteoBatch.concat([picked, batch.select(torch.tensor([0]))])
    assert torch.equal(joined.sparse_ids, batch.sparse_ids[[3, 1, 0]])
    moved = batch.to(torch.device("cpu"))
    assert moved is not batch and torch.equal(moved.sparse_features.values(), kjt.values())


def _rows_from_world(n: int) -> list[str]:
    """Criteo TSV rows with the generated world's structure (hex ids, raw counts)."""
    world = _synthetic(num_embeddings=1000).dataset(0, 1)
    out = []
    for i in range(n):
        dense, ids, label, _ = world[i]
        counts = np.rint(np.sign(dense) * np.expm1(np.abs(dense))).astype(int)
        out.append(row(int(label), [str(c) for c in counts], [f"{v:08x}" for v in ids]))
    return out


@pytest.mark.timeout(300)
def test_recsys_train_on_a_criteo_file_and_its_errors(tmp_path):
    good = write(tmp_path, _rows_from_world(3000))
    common = ["model=dlrm", "data=criteo", "data.num_embeddings=1000", f"trainer.output_dir={tmp_path}/runs"]
    proc = fork_ranks(
        BIN / "recsys-train", *common, f"data.path={good}", "trainer=smoke", "trainer.max_steps=40", nproc=1
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = (tmp_path / "runs").glob("recsys-train/*/metrics.jsonl")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 40
    assert {"auc", "log_loss"} <= set(records[-1])
    bad = write(tmp_path, [row(), row(ints=["1", "2.5", *["0"] * 11])], "bad.txt")
    proc = fork_ranks(BIN / "recsys-train", *common, f"data.path={bad}", nproc=1)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"error: data.path: {bad}:2: column int_1 ('2.5') is not an integer" in proc.stderr
    assert "Traceback" not in proc.stderr
