"""The streaming Parquet sources (`data=parquet`, `data=parquet_sequences`): rows shared by
position, shuffled in windows, resumed exactly (also on another world size), bad files refused in
one line, and the same batches as the file sources they replace."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsys_pipe.config import ConfigError
from recsys_pipe.data.ids import fnv1a64, splitmix64
from recsys_pipe.data.in_memory.criteo import CriteoDataConfig
from recsys_pipe.data.in_memory.sequences import SequencesDataConfig
from recsys_pipe.data.negatives import TRAIN, unseen_items
from recsys_pipe.data.parquet.decode import item_vocab_metadata
from recsys_pipe.data.parquet.files import DataFileError
from recsys_pipe.data.parquet.sequences import ParquetSequencesDataConfig
from recsys_pipe.data.parquet.stream import Layout, rank_pieces
from recsys_pipe.data.parquet.tabular import ParquetDataConfig
from recsys_pipe.data.source import RankData

CRITEO_COLUMNS = ["label", *(f"int_{i}" for i in range(13)), *(f"cat_{i}" for i in range(26))]


def criteo_table(n: int, seed: int = 0) -> pa.Table:
    """Criteo-layout rows as `recsys-data convert criteo` writes them."""
    rng = np.random.default_rng(seed)
    cols = {"label": pa.array(rng.integers(0, 2, n).astype(np.int8))}
    for i in range(13):
        cols[f"int_{i}"] = pa.array(rng.integers(-3, 5000, n))
    for i in range(26):
        cols[f"cat_{i}"] = pa.array(rng.integers(0, 2**32, n))
    return pa.table(cols)


def write_parts(directory, table: pa.Table, sizes: list[int], row_group: int) -> str:
    """`table` split into files of `sizes` rows (row groups of `row_group`); returns a glob."""
    start = 0
    for k, size in enumerate(sizes):
        pq.write_table(table.slice(start, size), directory / f"part-{k:03d}.parquet", row_group_size=row_group)
        start += size
    return str(directory / "*.parquet")


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    """600 Criteo rows in three uneven files (row groups of 70), and the same rows as a TSV."""
    d = tmp_path_factory.mktemp("criteo")
    table = criteo_table(600)
    glob = write_parts(d, table, [250, 50, 300], 70)
    rows = table.to_pydict()
    with open(d / "train.txt", "w") as f:
        for r in range(600):
            ints = [str(rows[f"int_{i}"][r]) for i in range(13)]
            cats = [format(rows[f"cat_{i}"][r], "x") for i in range(26)]
            f.write("\t".join([str(rows["label"][r]), *ints, *cats]) + "\n")
    return glob, str(d / "train.txt")


def parquet(path, **kw) -> ParquetDataConfig:
    return ParquetDataConfig(path=path, num_embeddings=kw.pop("num_embeddings", 997), **kw)


def trained_ids(cfg, world: int, epochs: int = 1, start: int = 0) -> list[list[torch.Tensor]]:
    """Per rank, the sample ids of every batch it trains."""
    return [[b.sample_ids for b in RankData(cfg, r, world).train_loader(epochs, start)] for r in range(world)]


# -- the same batches as data=criteo ---------------------------------------------------------------


def test_criteo_layout_gives_the_batches_of_data_criteo(criteo):
    glob, tsv = criteo
    ref = RankData(CriteoDataConfig(path=tsv, batch_size=32, num_embeddings=997), 0, 1)
    got = RankData(parquet(glob, batch_size=32), 0, 1)
    assert got.batches_per_epoch == ref.batches_per_epoch == 18
    assert got.spec == ref.spec
    for a, b in zip(ref.train_loader(), got.train_loader(), strict=True):
        for name in ("dense_features", "sparse_ids", "labels", "sample_ids"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert b.sparse_features.keys() == a.sparse_features.keys()


# -- sharing and shuffling ---------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(1, 60), min_size=1, max_size=4),
    row_group=st.integers(1, 40),
    world=st.integers(1, 6),
    batch=st.integers(1, 8),
    window=st.integers(1, 50),
    shuffle=st.booleans(),
)
def test_every_rank_trains_as_many_batches_and_no_row_twice(
    tmp_path_factory, sizes, row_group, world, batch, window, shuffle
):
    """Uneven files, more ranks than files or row groups: every rank has the same batches per
    epoch from the metadata, and the ranks' rows are disjoint."""
    total = sum(sizes)
    if total < world * batch:
        return
    glob = write_parts(tmp_path_factory.mktemp("p"), criteo_table(total), sizes, row_group)
    cfg = parquet(glob, batch_size=batch, shuffle=shuffle, shuffle_window=window, seed=3)
    ranks = trained_ids(cfg, world)
    per_epoch = total // (world * batch)
    assert all(len(batches) == per_epoch for batches in ranks)
    assert all(b.numel() == batch for batches in ranks for b in batches)
    ids = torch.cat([b for batches in ranks for b in batches])
    assert len(set(ids.tolist())) == ids.numel() == per_epoch * world * batch
    assert int(ids.max()) < total


def test_the_shuffle_is_seeded_per_epoch_and_stays_within_a_window(criteo):
    glob, _ = criteo
    cfg = parquet(glob, batch_size=10, shuffle=True, shuffle_window=100, seed=5)
    ids = torch.cat(trained_ids(cfg, 1, epochs=2)[0])
    first, second = ids[:600], ids[600:]
    assert sorted(first.tolist()) == list(range(600)) and not torch.equal(first, second)
    assert torch.equal(torch.cat(trained_ids(cfg, 1, epochs=2)[0]), ids)  # the same again
    assert not torch.equal(torch.cat(trained_ids(parquet(glob, batch_size=10, shuffle=True, seed=6), 1)[0]), first)
    # each window of 100 rows holds the next 100 rows of the epoch's row-group order, permuted
    order = RankData(cfg, 0, 1).stream.order
    for w in range(6):
        slices = order.locate(0, 100 * w, 100 * (w + 1))
        rows = {g0 + i for _, _, lo, hi, g0 in slices for i in range(hi - lo)}
        assert set(first[100 * w : 100 * (w + 1)].tolist()) == rows
    assert [s[:2] for s in order.locate(0, 0, 600)] != [s[:2] for s in order.locate(1, 0, 600)]  # row groups move


# -- exact resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("workers", "worlds", "starts"), [(0, (1, 3), (0, 1, 5, -1, 0, 4)), (2, (2,), (5, 4))])
def test_a_resumed_loader_continues_with_the_same_batches(criteo, workers, worlds, starts):
    """The first half of `starts` are batches of epoch 1, the rest of epoch 2 (-1: its last
    batch): a resume mid-epoch, at the boundary and in the next epoch, with and without workers."""
    glob, _ = criteo
    cfg = parquet(glob, batch_size=16, shuffle=True, shuffle_window=48, seed=1, num_workers=workers)
    for world in worlds:
        full = trained_ids(cfg, world, epochs=2)
        per_epoch = len(full[0]) // 2
        half = len(starts) // 2
        for k, start in enumerate(starts):
            start = start % per_epoch + (per_epoch if k >= half else 0)
            resumed = trained_ids(cfg, world, epochs=2, start=start)
            for r in range(world):
                assert len(resumed[r]) == len(full[r]) - start
                assert all(torch.equal(a, b) for a, b in zip(resumed[r], full[r][start:])), (world, start)


@settings(max_examples=40, deadline=None)
@given(
    worlds=st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=2, max_size=4),
    cuts=st.lists(st.integers(0, 12), min_size=3, max_size=3),
    window=st.sampled_from([12, 24, 36, 1000]),
)
def test_a_change_of_world_size_trains_every_row_of_the_epoch_once(worlds, cuts, window):
    """Global batch 12 kept over 1..4 layouts of one 12-batch epoch: the pieces of the ranks of
    each layout, from where it took over, cover the rows the earlier layouts left, once."""
    batches, global_batch = 12, 12
    sinces = sorted(cuts[: len(worlds) - 1])
    layouts = [Layout(worlds[0], global_batch // worlds[0], 0)]
    for world, since in zip(worlds[1:], sinces):
        layouts.append(Layout(world, global_batch // world, since))
    rows: list[int] = []
    for k, layout in enumerate(layouts):
        stop = layouts[k + 1].since if k + 1 < len(layouts) else batches
        for r in range(layout.world):
            pieces = rank_pieces(0, layouts[: k + 1], r, batches, window)
            flat = [p.start + p.skip + i for p in pieces for i in range(p.take)]  # rows, without a shuffle
            assert len(flat) == (batches - layout.since) * layout.batch
            rows += flat[: (stop - layout.since) * layout.batch]
    assert sorted(rows) == list(range(batches * global_batch))


def test_resume_on_another_world_size_continues_the_epoch_with_the_rows_not_trained(criteo):
    """2 ranks x 12 rows to step 5, then 3 ranks x 8 to step 9, then 1 rank x 24 to the end
    (checkpoints carry the layouts): across the three runs every row of the epoch once."""
    glob, _ = criteo
    common = {"shuffle": True, "shuffle_window": 48, "seed": 2}
    runs = [(2, 12, 0, 5), (3, 8, 5, 9), (1, 24, 9, None)]
    seen: list[int] = []
    layout = None
    state = None
    for world, batch, start, stop in runs:
        cfg = parquet(glob, batch_size=batch, **common)
        for r in range(world):
            data = RankData(cfg, r, world)
            position = start
            if state is not None:
                position = data.resume_position(start, *state, layouts=layout)
                assert position == start
            batches = list(data.train_loader(1, position))
            take = (stop or data.batches_per_epoch) - start
            seen += torch.cat([b.sample_ids for b in batches[:take]]).tolist()
            if r == 0 and stop is not None:
                next_layout = data.layout_state(stop)
        state = (world, batch, data.batches_per_epoch)
        layout = next_layout
    assert data.batches_per_epoch == 600 // 24
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 25 * 24


def test_another_global_batch_size_is_refused_in_one_line(criteo):
    glob, _ = criteo
    data = RankData(parquet(glob, batch_size=10), 0, 1)
    with pytest.raises(
        ConfigError,
        match=r"^data.batch_size: the checkpoint trained 2 rank\(s\) x data.batch_size=16 "
        r"= 32 rows per step, this run 1 x 10: keep the global batch size .*set data.batch_size=32\)$",
    ):
        data.resume_position(3, 2, 16, 18, "2x16@0")


def test_a_map_style_source_continues_the_same_epoch_on_another_world_size(caplog):
    """The 2-rank checkpoint at step 170 of 256-batch epochs resumed on 1 rank: it continues in
    epoch 1 at the same share of it (it used to jump to the epoch's end and train nothing)."""
    from recsys_pipe.data.in_memory.synthetic import SyntheticDataConfig

    cfg = SyntheticDataConfig(num_batches=256, batch_size=2, synthetic={"num_samples": 1024})
    data = RankData(cfg, 0, 1)
    assert data.resume_position(170, 2, 2, 256) == 170
    assert "epoch 1 continues at the same share of it (batch 170 of 256" in caplog.text
    assert data.resume_position(128 + 85, 2, 2, 128) == 256 + 170  # epoch 2, two thirds in
    assert data.resume_position(170, 1, 2, 256) == 170  # the same layout: as it is


# -- workers hand windows over in shared blocks ------------------------------------------------------


def _criteo_fields(batch) -> list[torch.Tensor]:
    return [batch.dense_features, batch.sparse_ids, batch.labels, batch.sample_ids]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    workers=st.sampled_from([1, 2]),
    batch_size=st.sampled_from([8, 24]),
    window=st.sampled_from([16, 100]),
    shuffle=st.booleans(),
    start=st.integers(0, 30),
    depth=st.sampled_from([0, 1, 3]),
)
def test_workers_hand_windows_over_in_reused_blocks_and_every_batch_stays_intact(
    criteo, workers, batch_size, window, shuffle, start, depth
):
    """Every batch is bitwise the one decoded in this process, although the workers reuse their
    blocks: all batches are held to the end (a block reused under one would change it). Depth 0:
    every window crosses in fresh shared memory; 1: blocks or fresh memory as the schedule
    falls; 3, the default: always in blocks."""
    from unittest import mock

    from recsys_pipe.data.parquet import stream

    glob, _ = criteo
    kw = {"batch_size": batch_size, "shuffle": shuffle, "shuffle_window": window, "seed": 3}
    local = list(RankData(parquet(glob, **kw), 0, 1).train_loader(2, start))
    with mock.patch.object(stream, "_RING_DEPTH", depth):
        loader = RankData(parquet(glob, num_workers=workers, **kw), 0, 1).train_loader(2, start)
        handed = list(loader)
    assert len(handed) == len(local) > 0
    _assert_handed_over_intact(handed, local, _criteo_fields, loader.handoffs, depth)


def _assert_handed_over_intact(handed, local, fields, handoffs, depth) -> None:
    """Every batch a worker handed over equals (values and dtypes) the one decoded in this process,
    and the pieces crossed as ring depth `depth` says: 0, always fresh shared memory; the
    default (`_PREFETCH + 1`), always reused blocks."""
    from recsys_pipe.data.parquet import stream

    for a, b in zip(handed, local, strict=True):
        assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(fields(a), fields(b)))
    pieces = sum(handoffs.values())
    assert pieces > 0
    if depth == 0:
        assert handoffs["fresh"] == pieces
    if depth == stream._PREFETCH + 1:
        assert handoffs["block"] == pieces


# -- held-out rows -----------------------------------------------------------------------------------


def test_evaluation_rows_are_the_tail_or_the_eval_files(criteo, tmp_path):
    glob, _ = criteo
    data = RankData(parquet(glob, batch_size=20), 0, 2, eval_batches=3)
    assert data.batches_per_epoch == (600 - 120) // 40
    train = torch.cat([b.sample_ids for b in data.train_loader()])
    held = torch.cat([b.sample_ids for b in data.eval_loader()])
    assert held.tolist() == list(range(480, 540)) and int(train.max()) < 480
    pq.write_table(criteo_table(100, seed=9), tmp_path / "eval.parquet", row_group_size=30)
    data = RankData(parquet(glob, batch_size=20, eval_path=str(tmp_path / "eval.parquet")), 1, 2)
    assert data.batches_per_epoch == 15 and data.eval_batches == 2  # trainer.eval_batches=0: all of it
    assert torch.cat([b.sample_ids for b in data.eval_loader()]).tolist() == list(range(40, 80))


# -- column mapping and ids ---------------------------------------------------------------------------


def _splitmix_reference(x: int) -> int:
    """SplitMix64's finaliser, in Python integers (the published algorithm)."""
    m = 2**64 - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _fnv_reference(s: str) -> int:
    h = 0xCBF29CE484222325
    for byte in s.encode():
        h = ((h ^ byte) * 0x100000001B3) & (2**64 - 1)
    return h


def test_hashing_is_the_published_arithmetic():
    raw = np.array([0, 1, -1, 2**63 - 1, 123456789], dtype=np.int64)
    assert splitmix64(raw).tolist() == [_splitmix_reference(int(x) % 2**64) for x in raw]
    words = ["", "a", "user-42", "ünïcode"]
    assert fnv1a64(pa.array(words)).tolist() == [_fnv_reference(w) for w in words]
    assert fnv1a64(pa.array(words)).tolist()[1] == 0xAF63DC4C8601EC8C  # FNV-1a("a"), the reference value


def test_a_column_mapping_with_several_labels_lists_and_strings(tmp_path):
    rng = np.random.default_rng(0)
    n = 90
    lists = [list(rng.integers(0, 50, rng.integers(0, 4))) for _ in range(n)]
    table = pa.table(
        {
            "click": rng.integers(0, 2, n).astype(np.int8),
            "like": rng.random(n) < 0.3,
            "price": rng.random(n),
            "age": rng.integers(0, 90, n),
            "shop": pa.array([f"shop-{i % 7}" for i in range(n)]),
            "tags": pa.array(lists, pa.list_(pa.int64())),
            "item": rng.integers(0, 10, n),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=40)
    cfg = ParquetDataConfig(
        path=str(tmp_path / "t.parquet"),
        batch_size=30,
        columns={
            "labels": ["click", "like"],
            "dense": ["price", "age"],
            "sparse": {
                "shop": {"num_embeddings": 1000},
                "tags": {"num_embeddings": 64, "ids": "modulo"},
                "item": {"num_embeddings": 10, "ids": "as_is"},
            },
        },
    )
    assert cfg.multi_hot_features() == ["tags"]
    data = RankData(cfg, 0, 1)
    assert data.spec.num_tasks == 2 and data.spec.num_dense == 2
    assert dict(data.spec.vocab_sizes) == {"shop": 1000, "tags": 64, "item": 10}
    batches = list(data.train_loader())
    assert len(batches) == 3
    b = batches[1]
    rows = list(range(30, 60))
    assert torch.equal(b.labels[:, 1], torch.tensor(table["like"].to_numpy()[rows], dtype=torch.float32))
    assert torch.equal(b.dense_features[:, 0], torch.tensor(table["price"].to_numpy()[rows], dtype=torch.float32))
    kjt = b.sparse_features
    assert kjt.keys() == ["shop", "tags", "item"]
    per = kjt.to_dict()
    shops = [int(fnv1a64(pa.array([f"shop-{i % 7}"]))[0]) for i in rows]
    assert per["shop"].values().tolist() == [_splitmix_reference(h) % 1000 for h in shops]
    assert per["tags"].lengths().tolist() == [len(lists[i]) for i in rows]
    assert per["tags"].values().tolist() == [int(v) % 64 for i in rows for v in lists[i]]
    assert per["item"].values().tolist() == table["item"].to_numpy()[rows].tolist()

    def fields(batch) -> list[torch.Tensor]:
        kjt = batch.sparse_features
        return [batch.labels, batch.dense_features, batch.sample_ids, kjt.values(), kjt.lengths()]

    # shuffled, through a worker's shared blocks (the lists in memory of their own): the same batches
    shuffled = cfg.model_copy(update={"shuffle": True, "shuffle_window": 60})
    local = list(RankData(shuffled, 0, 1).train_loader(2))
    handed = list(RankData(shuffled.model_copy(update={"num_workers": 1}), 0, 1).train_loader(2))
    assert len(handed) == len(local) == 6
    assert all(torch.equal(x, y) for a, b in zip(handed, local) for x, y in zip(fields(a), fields(b)))
    from recsys_pipe.testing import load_run

    with pytest.raises(ConfigError, match="dlrm_torch's plain tables take one id per row; features \\['tags'\\]"):
        load_run(
            "model=dlrm_torch",
            "data=parquet",
            f"data.path={tmp_path / 't.parquet'}",
            "+data.columns.sparse.tags.num_embeddings=4",
        )


# -- bad files: one line each, before the start -----------------------------------------------------


def _bad(tmp_path, name: str, table: pa.Table | None = None, raw: bytes | None = None, **write) -> str:
    path = tmp_path / name
    if raw is not None:
        path.write_bytes(raw)
    else:
        pq.write_table(table, path, **write)
    return str(path)


def _refused(path, message: str, **kw) -> None:
    with pytest.raises(ConfigError) as info:
        RankData(parquet(path, batch_size=4, **kw), 0, 1)
    text = str(info.value)
    assert "\n" not in text
    assert message in text, text


def test_bad_files_are_refused_in_one_line_naming_file_row_group_and_column(tmp_path):
    good = criteo_table(40)
    ok = _bad(tmp_path, "ok.parquet", good, row_group_size=20)
    _refused(_bad(tmp_path, "empty.parquet", good.slice(0, 0)), "empty.parquet: the file has no rows")
    _refused(_bad(tmp_path, "zero.parquet", raw=b""), "zero.parquet: not a Parquet file, or truncated")
    _refused(_bad(tmp_path, "text.parquet", raw=b"label\tint_0\n1\t2\n" * 20), "text.parquet: not a Parquet file")
    with open(ok, "rb") as f:
        data = f.read()
    _refused(_bad(tmp_path, "cut.parquet", raw=data[: len(data) // 2]), "cut.parquet: not a Parquet file, or truncated")
    _refused(_bad(tmp_path, "nolabel.parquet", good.drop_columns(["cat_7"])), "nolabel.parquet: no column 'cat_7'")
    strings = good.set_column(3, "int_2", pa.array([str(x) for x in good["int_2"].to_pylist()]))
    _refused(
        _bad(tmp_path, "str.parquet", strings),
        "str.parquet, column 'int_2': a dense column must be numeric, it is string",
    )
    nulls = good.set_column(20, "cat_6", pa.array([None] + good["cat_6"].to_pylist()[1:], pa.int64()))
    _refused(
        _bad(tmp_path, "null.parquet", nulls, row_group_size=20),
        "null.parquet, row group 0, column 'cat_6': 1 null value(s)",
    )
    negative = good.set_column(21, "cat_7", pa.array([5] * 25 + [-3] * 15, pa.int64()))
    _refused(
        _bad(tmp_path, "neg.parquet", negative, row_group_size=20),
        "neg.parquet, row group 1, column 'cat_7': a negative id (-3)",
    )
    other = tmp_path / "mixed"
    other.mkdir()
    pq.write_table(good, other / "a.parquet")
    pq.write_table(
        good.set_column(0, "label", pa.array(good["label"].to_numpy().astype(np.int64))), other / "b.parquet"
    )
    _refused(str(other), "b.parquet: a schema that differs from")
    _refused(str(tmp_path / "nothing*.parquet"), "matches no file")
    with pytest.raises(
        ConfigError,
        match=r"data.path: .*item.parquet, row group 1, column 'item': id 12 >= num_embeddings=10 with ids=as_is",
    ):
        t = pa.table({"label": [0, 1] * 10, "item": [1] * 15 + [12] * 5})
        RankData(
            ParquetDataConfig(
                path=_bad(tmp_path, "item.parquet", t, row_group_size=10),
                batch_size=4,
                columns={"sparse": {"item": {"num_embeddings": 10, "ids": "as_is"}}},
            ),
            0,
            1,
        )


def _corrupt_second_row_group(path: str) -> None:
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(1).column(3)
    start = col.data_page_offset
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\xff" * col.total_compressed_size)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_bad_row_group_met_mid_run_stops_with_the_same_line(tmp_path, workers):
    path = str(tmp_path / "late.parquet")
    pq.write_table(criteo_table(80), path, row_group_size=40)
    _corrupt_second_row_group(path)
    data = RankData(parquet(path, batch_size=8, num_workers=workers, shuffle_window=40), 0, 1)  # the footer is intact
    it = iter(data.train_loader())
    assert [next(it).sample_ids[0].item() for _ in range(5)] == [0, 8, 16, 24, 32]
    with pytest.raises(DataFileError) as info:
        next(it)
    text = str(info.value)
    assert text.startswith(f"data.path: {path}, row group 1: cannot be decoded (") and "\n" not in text


def test_a_negative_id_without_statistics_is_found_when_decoded(tmp_path):
    table = criteo_table(40).set_column(14, "cat_0", pa.array([1] * 30 + [-1] * 10, pa.int64()))
    path = _bad(tmp_path, "nostats.parquet", table, row_group_size=20, write_statistics=False)
    data = RankData(parquet(path, batch_size=10), 0, 1)
    with pytest.raises(
        DataFileError, match=r"nostats.parquet, row 30 \(row group 1\), column 'cat_0': a negative id \(-1\)"
    ):
        list(data.train_loader())


# -- sequences ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sequences(tmp_path_factory):
    """120 users' "user item" lines and the same users as sequence Parquet (row groups of 25)."""
    d = tmp_path_factory.mktemp("seq")
    rng = np.random.default_rng(1)
    users = np.arange(1, 121) * 5
    seqs = [list(rng.integers(0, 300, rng.integers(4, 25)) * 3 + 7) for _ in users]
    with open(d / "seq.txt", "w") as f:
        f.writelines(f"{u} {i}\n" for u, s in zip(users, seqs) for i in s)
    table = pa.table({"user_id": pa.array(users, pa.int64()), "item_ids": pa.array(seqs, pa.list_(pa.int64()))})
    pq.write_table(
        table.replace_schema_metadata(item_vocab_metadata(np.concatenate(seqs))), d / "seq.parquet", row_group_size=25
    )
    return str(d / "seq.txt"), str(d / "seq.parquet")


@pytest.mark.parametrize("per_target", [1, 3])
def test_sequence_parquet_gives_the_batches_and_splits_of_data_sequences(sequences, per_target):
    """Bitwise the batches of data=sequences, with one negative per target or several (a model's
    per-position negatives: `negatives_per_target`, target by target)."""
    txt, pqt = sequences
    kw = {"batch_size": 16, "shuffle": False, "max_seq_len": 8, "eval_negatives": 20}
    ref = RankData(SequencesDataConfig(path=txt, **kw).with_negatives_per_target(per_target), 0, 1)
    got = RankData(ParquetSequencesDataConfig(path=pqt, **kw).with_negatives_per_target(per_target), 0, 1)
    assert got.batches_per_epoch == ref.batches_per_epoch and got.spec == ref.spec
    for a, b in zip(ref.train_loader(2), got.train_loader(2), strict=True):  # negatives drawn again in epoch 2
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
        assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
        assert torch.equal(a.neg_index, b.neg_index)
        negatives = a.negatives_per_position()  # per_target > 1: the distinct ones in the KJT, and their places
        assert negatives.numel() == a.sparse_features["pos"].values().numel() * per_target
        assert a.neg_index.numel() == (negatives.numel() if per_target > 1 else 0)
        assert torch.equal(a.timestamps, b.timestamps) and torch.equal(a.sample_ids, b.sample_ids)
        assert torch.equal(a.target_timestamps, b.target_timestamps)  # HSTU's time bias reads them
    for name in ("valid", "test"):
        sa, sb = ref.dataset.split(name, 16), got.dataset.split(name, 16)
        assert len(sa) == len(sb)
        xa = sa.collate([sa[i] for i in range(len(sa))])
        xb = sb.collate([sb[i] for i in range(len(sb))])
        assert torch.equal(xa.sparse_features.values(), xb.sparse_features.values())
        assert torch.equal(xa.sample_ids, xb.sample_ids)
        assert torch.equal(xa.target_timestamps, xb.target_timestamps)
    assert got.dataset.raw_users[7] == 40 and got.dataset.held_out(7, "test") == ref.dataset.held_out(7, "test")


@pytest.mark.parametrize("per_target", [1, 4])
def test_sequence_parquet_resumes_by_position_with_workers(sequences, per_target):
    _, pqt = sequences
    cfg = ParquetSequencesDataConfig(path=pqt, batch_size=8, shuffle=True, shuffle_window=24, num_workers=2)
    cfg = cfg.with_negatives_per_target(per_target)
    full = [b.sparse_features.values() for b in RankData(cfg, 1, 2).train_loader(2)]
    resumed = [b.sparse_features.values() for b in RankData(cfg, 1, 2).train_loader(2, 9)]
    assert len(full) == 14 and all(torch.equal(a, b) for a, b in zip(full[9:], resumed, strict=True))


@pytest.fixture(scope="module")
def stamped_sequences(sequences, tmp_path_factory):
    """The users of `sequences` with a timestamp column (row groups of 25)."""
    table = pq.read_table(sequences[1])
    rng = np.random.default_rng(2)
    stamps = [sorted(rng.integers(0, 10**9, len(s)).tolist()) for s in table["item_ids"].to_pylist()]
    path = tmp_path_factory.mktemp("stamped") / "seq.parquet"
    pq.write_table(table.append_column("timestamps", pa.array(stamps, pa.list_(pa.int64()))), path, row_group_size=25)
    return str(path)


def _retrieval_fields(batch) -> list[torch.Tensor]:
    kjt = batch.sparse_features
    return [kjt.values(), kjt.lengths(), batch.timestamps, batch.sample_ids, batch.target_timestamps, batch.neg_index]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    workers=st.sampled_from([1, 2]),
    part=st.sampled_from([8, 24, 1 << 20]),
    per_target=st.sampled_from([1, 3]),
    stamped=st.booleans(),
    start=st.integers(0, 12),
    depth=st.sampled_from([0, 1, 3]),
)
def test_sequence_workers_hand_parts_over_in_reused_blocks_and_every_batch_stays_intact(
    sequences, stamped_sequences, workers, part, per_target, stamped, start, depth
):
    """The training rows of sequence parts cross in the workers' reused blocks as Criteo's
    windows do: every batch (ids, negatives, lengths, timestamps, sample ids, target times) is
    bitwise the one decoded in this process, all held to the end; depth 0: fresh shared memory
    every time, 3 (the default): always blocks."""
    from unittest import mock

    import recsys_pipe.data.parquet.sequences as source
    from recsys_pipe.data.parquet import stream

    path = stamped_sequences if stamped else sequences[1]
    kw = {"path": path, "batch_size": 8, "shuffle": True, "shuffle_window": 40, "max_seq_len": 6, "seed": 5}
    cfg = ParquetSequencesDataConfig(**kw).with_negatives_per_target(per_target)
    with mock.patch.object(source, "_PART_ROWS", part):
        local = list(RankData(cfg, 0, 1).train_loader(2, start))
        with mock.patch.object(stream, "_RING_DEPTH", depth):
            loader = RankData(cfg.model_copy(update={"num_workers": workers}), 0, 1).train_loader(2, start)
            handed = list(loader)
    assert len(handed) == len(local) == 30 - start
    _assert_handed_over_intact(handed, local, _retrieval_fields, loader.handoffs, depth)


def _negatives_by_user(data: RankData, epochs: int) -> dict[tuple[int, int], list[int]]:
    """(epoch, user) -> that user's training negatives, from the batches of `data`."""
    out = {}
    for b, batch in enumerate(data.train_loader(epochs)):
        neg = batch.sparse_features["neg"]
        for user, ids in zip(batch.sample_ids.tolist(), torch.split(neg.values(), neg.lengths().tolist())):
            out[b // data.batches_per_epoch, user] = ids.tolist()
    return out


def test_sequence_negatives_depend_on_the_user_not_its_batch_rank_or_worker(sequences):
    """Each user's negatives are the same whatever batch size, shuffle, rank count or worker
    count delivers them, and equal to the user's own draw (`unseen_items` for it alone)."""
    _, pqt = sequences
    one = _negatives_by_user(RankData(ParquetSequencesDataConfig(path=pqt, batch_size=16, shuffle=False), 0, 1), 2)
    cfg = ParquetSequencesDataConfig(path=pqt, batch_size=8, shuffle=True, shuffle_window=24, num_workers=2)
    for rank in range(2):
        other = _negatives_by_user(RankData(cfg, rank, 2), 2)
        assert len(other) > 40 and all(one[key] == ids for key, ids in other.items())
    data = RankData(ParquetSequencesDataConfig(path=pqt, batch_size=16, shuffle=False), 0, 1).dataset
    _, seq, _ = data._rows.user(7)
    train = seq[:-2]
    alone = unseen_items(0, TRAIN, 1, [7], [len(one[1, 7])], train, [0], [len(train)], data.num_items)
    assert one[1, 7] == alone.tolist() and not set(alone.tolist()) & set(train.tolist())


def test_sequence_windows_give_the_same_batches_in_parts_of_any_size(sequences, monkeypatch):
    """A window is handed out in parts (`_PART_ROWS` users); the size of the parts changes no
    batch: parts of one batch, of three, and whole windows give bitwise the same batches."""
    import recsys_pipe.data.parquet.sequences as source

    _, pqt = sequences
    cfg = ParquetSequencesDataConfig(path=pqt, batch_size=8, shuffle=True, shuffle_window=40, num_workers=1)
    runs = []
    for part in (8, 24, 1 << 20):
        monkeypatch.setattr(source, "_PART_ROWS", part)
        runs.append(
            [(b.sparse_features.values(), b.timestamps, b.sample_ids) for b in RankData(cfg, 0, 1).train_loader(2)]
        )
    assert len(runs[0]) == 2 * 15
    for other in runs[1:]:
        assert all(all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(runs[0], other, strict=True))


def test_sequence_files_without_a_vocabulary_need_num_items(tmp_path):
    t = pa.table({"user_id": [1, 2], "item_ids": pa.array([[0, 1, 2], [3, 4, 9]], pa.list_(pa.int64()))})
    pq.write_table(t, tmp_path / "s.parquet")
    with pytest.raises(ConfigError, match="no item vocabulary .* set data.num_items"):
        RankData(ParquetSequencesDataConfig(path=str(tmp_path / "s.parquet"), batch_size=1, eval_negatives=2), 0, 1)
    cfg = ParquetSequencesDataConfig(path=str(tmp_path), batch_size=1, eval_negatives=2, num_items=9)
    with pytest.raises(  # the row group's statistics show it: before the start
        DataFileError, match=r"s.parquet, row group 0, column 'item_ids': item id 9 outside \[0, data.num_items=9\)"
    ):
        RankData(cfg, 0, 1)
    pq.write_table(t, tmp_path / "s.parquet", write_statistics=False)  # then only decoding finds it
    with pytest.raises(DataFileError, match=r"s.parquet, row 1 \(row group 0\), column 'item_ids': item id 9 outside"):
        list(RankData(cfg, 0, 1).train_loader())


def test_a_bad_sequence_id_names_its_row_group_when_decoded_in_shuffled_parts(tmp_path):
    """Windows are decoded in parts of their permuted rows: an error still names the row group
    of the bad row, not the part's."""
    seqs = [[u % 7, (u + 1) % 7, (u + 2) % 7, (u + 3) % 7] for u in range(24)]
    seqs[21][2] = 12  # row group 2 (rows 16..23)
    t = pa.table({"user_id": pa.array(range(24)), "item_ids": pa.array(seqs, pa.list_(pa.int64()))})
    pq.write_table(t, tmp_path / "s.parquet", row_group_size=8, write_statistics=False)
    cfg = ParquetSequencesDataConfig(
        path=str(tmp_path / "s.parquet"), batch_size=2, eval_negatives=2, num_items=9, shuffle_window=24
    )
    with pytest.raises(DataFileError, match=r"row 21 \(row group 2\), column 'item_ids': item id 12 outside"):
        list(RankData(cfg, 0, 1).train_loader())


# -- recsys-data inspect ----------------------------------------------------------------------------


def test_inspect_shows_files_and_each_ranks_share(criteo, capsys):
    from recsys_pipe.cli.data import main

    glob, tsv = criteo
    assert main(["inspect", glob, "--world-size", "4", "--batch-size", "32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("3 file(s), 600 rows, 10 row group(s), ")
    assert "  label: int8\n" in out and "  cat_25: int64\n" in out
    assert "part-001.parquet: 50 rows in 1 row group(s) of 50..50 rows" in out
    assert "4 rank(s) x batch 32: 4 batches per epoch on every rank (512 rows; 88 left out per epoch)" in out
    assert f"  rank 3: rows 384..511 of the epoch, 3 row group(s) in {glob.replace('*', 'part-002')}\n" in out
    assert main(["inspect", tsv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tsv}: not a Parquet file, or truncated") and err.count("\n") == 1


# -- object storage ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint():
    """A local S3-compatible endpoint (moto's server, in this process); its host:port."""
    server_module = pytest.importorskip("moto.server", reason="moto[server] (the test extra) is not installed")
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"{host}:{port}"
    finally:
        server.stop()


def test_an_s3_uri_streams_the_same_batches_as_the_local_files(criteo, s3_endpoint, monkeypatch):
    import glob as globbing
    import os

    import boto3

    for key, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)
    client = boto3.client("s3", endpoint_url=f"http://{s3_endpoint}", region_name="us-east-1")
    client.create_bucket(Bucket="clicks")
    local, _ = criteo
    for path in sorted(globbing.glob(local)):
        client.upload_file(path, "clicks", f"day0/{os.path.basename(path)}")
    query = f"?endpoint_override={s3_endpoint}&scheme=http"
    kw = {"batch_size": 16, "shuffle": True, "shuffle_window": 64, "num_workers": 1}
    remote = RankData(parquet(f"s3://clicks/day0/*.parquet{query}", **kw), 1, 2)
    here = RankData(parquet(local, **kw), 1, 2)
    assert remote.batches_per_epoch == here.batches_per_epoch == 18
    for a, b in zip(remote.train_loader(), here.train_loader(), strict=True):
        assert torch.equal(a.sparse_ids, b.sparse_ids) and torch.equal(a.sample_ids, b.sample_ids)
    client.put_object(Bucket="clicks", Key="bad/x.parquet", Body=b"not parquet")
    with pytest.raises(ConfigError, match=r"^data.path: s3://clicks/bad/x.parquet: not a Parquet file"):
        RankData(parquet(f"s3://clicks/bad/{query}", batch_size=4), 0, 1)


def test_negatives_match_data_sequences_when_users_saw_most_items(tmp_path):
    """12 items, sequences of up to 10: many draws are rejected and redrawn (several rounds),
    the same in both sources."""
    rng = np.random.default_rng(4)
    seqs = [list(rng.integers(0, 12, rng.integers(4, 11))) for _ in range(60)]
    (tmp_path / "s.txt").write_text("".join(f"{u} {i}\n" for u, s in enumerate(seqs, 1) for i in s))
    table = pa.table({"user_id": pa.array(range(1, 61)), "item_ids": pa.array(seqs, pa.list_(pa.int64()))})
    pq.write_table(table.replace_schema_metadata(item_vocab_metadata(np.concatenate(seqs))), tmp_path / "s.parquet")
    kw = {"batch_size": 10, "shuffle": False, "max_seq_len": 6, "eval_negatives": 3}
    ref = RankData(SequencesDataConfig(path=str(tmp_path / "s.txt"), **kw), 0, 1)
    got = RankData(ParquetSequencesDataConfig(path=str(tmp_path / "s.parquet"), **kw), 0, 1)
    for a, b in zip(ref.train_loader(2), got.train_loader(2), strict=True):
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())


def test_recsys_train_refuses_a_bad_file_before_anything_starts(tmp_path, capsys, no_process_group):
    """`recsys-train` (and `--check`, which runs the same checks before torchrun) exits 2 with
    the one line, before a process group or a run directory exists."""
    from recsys_pipe.cli.train import run

    bad = _bad(tmp_path, "cut.parquet", raw=b"PAR1" + b"\0" * 64)
    for check in ([], ["--check"]):
        code = run([*check, "model=dlrm", "data=parquet", f"data.path={bad}", f"trainer.output_dir={tmp_path}/runs"])
        err = capsys.readouterr().err
        assert code == 2, err[-2000:]
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert lines == [f"error: data.path: {bad}: not a Parquet file, or truncated ({lines[0].split('(', 1)[1]}"]
        assert "Traceback" not in err and not (tmp_path / "runs").exists()
