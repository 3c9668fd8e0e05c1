"""recsys_pipe.data: batch layout, determinism, rank disjointness, Pipelineable, MovieLens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torchrec.streamable import Pipelineable

from recsys_pipe.config import ConfigError
from recsys_pipe.data import (
    ACTION_KEY,
    DATA_SOURCES,
    ITEM_KEY,
    MASKED_ACTION,
    USER_KEY,
    MovieLensDataConfig,
    MovieLensDataset,
    SequenceBatch,
    SyntheticConfig,
    SyntheticDataConfig,
    SyntheticSequenceDataset,
    make_dataloader,
    read_ratings,
)

SMALL = SyntheticConfig(num_items=100, num_users=50, num_clusters=4, num_samples=400)


def _cfg(**kw) -> SyntheticDataConfig:
    base = {"batch_size": 8, "max_seq_len": 12, "num_candidates": 3, "synthetic": SMALL}
    base.update(kw)
    return SyntheticDataConfig(**base)


def _batches(cfg: SyntheticDataConfig, rank: int = 0, world_size: int = 1, n: int = 3) -> list[SequenceBatch]:
    it = iter(make_dataloader(cfg, rank, world_size))
    return [next(it) for _ in range(n)]


def _assert_batches_equal(a: SequenceBatch, b: SequenceBatch) -> None:
    fa, fb = a.sparse_features, b.sparse_features
    assert fa.keys() == fb.keys()
    assert torch.equal(fa.values(), fb.values()) and torch.equal(fa.lengths(), fb.lengths())
    for name in ("timestamps", "num_candidates", "labels", "sample_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("use_user", [False, True])
def test_synthetic_batch_layout(use_user: bool) -> None:
    cfg = _cfg(use_user_feature=use_user)
    batch = _batches(cfg, n=1)[0]
    spec = cfg.dataset(0, 1).spec
    assert (USER_KEY in spec.vocab_sizes) == use_user  # a user table only when batches carry the feature
    kjt = batch.sparse_features.to_dict()
    assert set(kjt) == {ITEM_KEY, ACTION_KEY} | ({USER_KEY} if use_user else set())
    items, actions = kjt[ITEM_KEY], kjt[ACTION_KEY]
    assert torch.equal(items.lengths(), actions.lengths())
    lengths = items.lengths()
    assert batch.batch_size == cfg.batch_size == lengths.numel()
    assert int(lengths.min()) > cfg.num_candidates and int(lengths.max()) <= cfg.max_seq_len
    assert batch.timestamps.shape == items.values().shape
    assert torch.equal(batch.num_candidates, torch.full((cfg.batch_size,), cfg.num_candidates))
    assert batch.labels.shape == (cfg.batch_size * cfg.num_candidates, spec.num_tasks)
    assert batch.labels.dtype == torch.float32 and set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    assert int(items.values().min()) >= 0 and int(items.values().max()) < spec.vocab_sizes[ITEM_KEY]
    assert int(actions.values().max()) < spec.vocab_sizes[ACTION_KEY]
    for seq_actions, seq_ts in zip(actions.to_dense(), torch.split(batch.timestamps, lengths.tolist())):
        assert (seq_actions[-cfg.num_candidates :] == MASKED_ACTION).all()
        assert (seq_actions[: -cfg.num_candidates] != MASKED_ACTION).all()
        assert (seq_ts[1:] > seq_ts[:-1]).all()
    if use_user:
        assert torch.equal(kjt[USER_KEY].lengths(), torch.ones(cfg.batch_size, dtype=torch.int32))
        assert int(kjt[USER_KEY].values().max()) < spec.vocab_sizes[USER_KEY]


def test_synthetic_deterministic_per_seed() -> None:
    for a, b in zip(_batches(_cfg(seed=3)), _batches(_cfg(seed=3))):
        _assert_batches_equal(a, b)
    other = _batches(_cfg(seed=4), n=1)[0]
    assert not torch.equal(other.sparse_features.values(), _batches(_cfg(seed=3), n=1)[0].sparse_features.values())


def test_workers_do_not_change_batches() -> None:
    for a, b in zip(_batches(_cfg()), _batches(_cfg(num_workers=2))):
        _assert_batches_equal(a, b)


def test_synthetic_disjoint_per_rank_and_independent_of_world_size() -> None:
    whole = SyntheticSequenceDataset(SMALL, 0, 12, 3)
    parts = [SyntheticSequenceDataset(SMALL, 0, 12, 3, rank=r, world_size=3) for r in range(3)]
    ids = [[p[i].sample_id for i in range(len(p))] for p in parts]
    assert all(len(x) == len(ids[0]) for x in ids)
    assert sum(map(len, ids)) == len({i for x in ids for i in x})  # disjoint
    for r, part in enumerate(parts):
        assert part[5] == whole[5 * 3 + r]  # a sample is a function of (seed, global index)
    with pytest.raises(IndexError):
        parts[0][len(parts[0])]


def test_loader_batches_disjoint_across_ranks() -> None:
    seen = [torch.cat([b.sample_ids for b in _batches(_cfg(), r, 2, n=4)]) for r in range(2)]
    assert not set(seen[0].tolist()) & set(seen[1].tolist())


def test_batch_is_pipelineable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches implement torchrec's Pipelineable without importing torchrec; they become its
    (virtual) subclasses when torchrec's sharding is loaded."""
    batch = _batches(_cfg(use_user_feature=True), n=1)[0]
    import recsys_pipe.models.sharding  # noqa: F401  (registers the batches)

    assert isinstance(batch, Pipelineable)
    moved = batch.to(torch.device("cpu"), non_blocking=True)
    assert isinstance(moved, SequenceBatch)
    _assert_batches_equal(moved, batch)

    # CPU tensors can neither be pinned nor record a stream: count the calls instead.
    calls: list[str] = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: calls.append("record"))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a: calls.append("pin") or t.clone())
    batch.record_stream(object())
    # KJT: values + lengths (+ offsets when computed); batch: 4 dense tensors
    assert calls.count("record") >= 6
    pinned = batch.pin_memory()
    assert isinstance(pinned, SequenceBatch) and calls.count("pin") >= 6
    _assert_batches_equal(pinned, batch)


def test_sources_are_looked_up_by_name() -> None:
    assert DATA_SOURCES.config_class({"name": "synthetic"}, "data") is SyntheticDataConfig
    assert DATA_SOURCES.config_class({"name": "movielens"}, "data") is MovieLensDataConfig
    with pytest.raises(ConfigError) as info:
        DATA_SOURCES.config_class({"name": "synthetik"}, "data")
    assert str(info.value) == (
        "data.name: unknown data source 'synthetik' (did you mean 'synthetic'?); "
        "known: synthetic, movielens, criteo, criteo_synthetic, sequences, parquet, parquet_sequences"
    )


def test_movielens_needs_an_existing_file(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="no such file"):
        MovieLensDataConfig(path=str(tmp_path / "missing.dat"))
    with pytest.raises(ValidationError, match="num_candidates .12. must be < max_seq_len .12."):
        _cfg(num_candidates=12)


def test_num_batches_and_seeded_shuffle() -> None:
    assert len(make_dataloader(_cfg(num_batches=5))) == 5
    with pytest.raises(ConfigError, match="data.num_batches: 1000 batches x data.batch_size=8"):
        make_dataloader(_cfg(num_batches=1000))
    shuffled = [b.sample_ids for b in make_dataloader(_cfg(num_batches=4, shuffle=True), 1, 2)]
    again = [b.sample_ids for b in make_dataloader(_cfg(num_batches=4, shuffle=True), 1, 2)]
    ids = torch.cat(shuffled)
    assert all(torch.equal(a, b) for a, b in zip(shuffled, again))
    assert len(shuffled) == 4 and len(set(ids.tolist())) == ids.numel()
    assert bool((ids % 2 == 1).all()) and not torch.equal(ids, ids.sort().values)


# ---- MovieLens ---------------------------------------------------------------------------

# (user, movie, rating, timestamp), deliberately out of time order
RATINGS = [
    (7, 50, 4.0, 300),
    (7, 10, 5.0, 100),
    (7, 30, 2.0, 200),
    (7, 20, 3.5, 400),
    (7, 40, 1.0, 500),
    (7, 60, 4.5, 600),
    (7, 10, 3.0, 700),
    (3, 20, 5.0, 10),
    (3, 30, 4.0, 20),
    (3, 60, 1.0, 30),
    (9, 10, 2.0, 5),
]


def _write(tmp_path: Path, fmt: str) -> Path:
    if fmt == "ml-1m":
        path = tmp_path / "ratings.dat"
        path.write_text("".join(f"{u}::{m}::{r:g}::{t}\n" for u, m, r, t in RATINGS))
    else:
        path = tmp_path / "ratings.csv"
        path.write_text("userId,movieId,rating,timestamp\n" + "".join(f"{u},{m},{r},{t}\n" for u, m, r, t in RATINGS))
    return path


@pytest.mark.parametrize("fmt", ["ml-1m", "ml-20m"])
def test_read_ratings_both_formats(tmp_path: Path, fmt: str) -> None:
    assert read_ratings(_write(tmp_path, fmt)) == [(u, m, float(r), t) for u, m, r, t in RATINGS]


def test_read_ratings_rejects_other_files(tmp_path: Path) -> None:
    bad = tmp_path / "movies.csv"
    bad.write_text("movieId,title\n1,Toy Story\n")
    with pytest.raises(ConfigError, match="movies.csv:1: unrecognised first line 'movieId,title"):
        read_ratings(bad)


@pytest.mark.parametrize("fmt", ["ml-1m", "ml-20m"])
def test_movielens_sequences(tmp_path: Path, fmt: str) -> None:
    ds = MovieLensDataset(_write(tmp_path, fmt), max_seq_len=4, num_candidates=1, use_user_feature=True)
    assert ds.spec.vocab_sizes == {ITEM_KEY: 6, ACTION_KEY: 11, USER_KEY: 3} and ds.spec.num_tasks == 2
    # user 3 -> one window; user 7 (7 ratings) -> windows [4:8) and [0:3) from the end;
    # user 9 has a single rating, too short for 1 history + 1 candidate.
    assert ds.num_windows == len(ds) == 3
    u3, u7_old, u7_new = (ds[i] for i in range(3))
    movie = {m: i for i, m in enumerate([10, 20, 30, 40, 50, 60])}
    assert u3.user == 0 and u7_new.user == 1
    assert u3.items == [movie[20], movie[30], movie[60]] and u3.timestamps == [10, 20, 30]
    assert u3.history_actions == [10, 8] and u3.labels == [[0.0, 0.0]]  # 1-star candidate
    assert u7_new.items == [movie[20], movie[40], movie[60], movie[10]]
    assert u7_new.history_actions == [7, 2, 9] and u7_new.labels == [[0.0, 0.0]]  # 3.0 stars
    assert u7_old.items == [movie[10], movie[30], movie[50]]
    assert u7_old.history_actions == [10, 4] and u7_old.labels == [[1.0, 0.0]]  # 4.0 stars
    assert [s.sample_id for s in (u3, u7_old, u7_new)] == [0, 1, 2]


def test_movielens_rank_split_and_loader(tmp_path: Path) -> None:
    path = _write(tmp_path, "ml-20m")
    parts = [MovieLensDataset(path, 4, 1, rank=r, world_size=2) for r in range(2)]
    assert [len(p) for p in parts] == [1, 1]
    assert parts[0][0].sample_id == 0 and parts[1][0].sample_id == 1
    cfg = MovieLensDataConfig(path=str(path), batch_size=2, max_seq_len=4, num_candidates=1, use_user_feature=True)
    (batch,) = list(make_dataloader(cfg))
    assert batch.sparse_features.keys() == [ITEM_KEY, ACTION_KEY, USER_KEY]
    assert batch.labels.shape == (2, 2)
