"""`ids: managed` in one process: the managed-collision module's added state and lookups, the
sharders, the data's raw ids, `preprocess.py`'s record, and every refusal before anything starts
(the training itself: tests/integration/test_raw_ids.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import JaggedTensor

from recsys_pipe.cli import train as train_cli
from recsys_pipe.data import preprocess
from recsys_pipe.data.ids import ManagedFeature, ManagedIds, managed_string_ids, spread_ids
from recsys_pipe.models.managed import (
    ManagedRows,
    RawIdRemap,
    SplitBagCollection,
    eviction_policy,
    remap_raw_ids,
    split_bag_collection,
)
from recsys_pipe.models.sharders import ManagedBagSharder, ManagedSequenceSharder

SPACE = 2**40


def _rows(n: int = 8, policy: str = "lru", interval: int = 3, **kwargs) -> ManagedRows:
    return ManagedRows(
        zch_size=n,
        device=torch.device("cpu"),
        eviction_policy=eviction_policy(policy),
        eviction_interval=interval,
        input_hash_size=SPACE,
        **kwargs,
    )


def _step(module: ManagedRows, ids: list[int]) -> list[int]:
    values = torch.tensor(ids, dtype=torch.int64)
    out = module({"t": JaggedTensor(values=values, lengths=torch.ones(len(ids), dtype=torch.int32))})
    return out["t"].values().tolist()


def _stream(seed: int, steps: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 20, (6,), generator=g) * 1_000_003).tolist() for _ in range(steps)]


@pytest.mark.parametrize("policy", ["lfu", "lru", "distance_lfu"])
def test_a_restored_history_continues_exactly_where_the_unbroken_module_was(policy):
    """torchrec keeps the ids counted since the last eviction in memory only; with the buffers
    (what DCP saves) and `history_state` (what the rank's own file saves) a module restored mid
    interval remaps and evicts as the unbroken one; with the buffers alone it does not."""
    batches = _stream(1, 12)
    unbroken = _rows(policy=policy)
    expected = [_step(unbroken, b) for b in batches]
    first = _rows(policy=policy)
    for b in batches[:4]:  # an eviction at step 3: step 4 is counted but not yet evicted
        _step(first, b)
    restored = _rows(policy=policy)
    restored.load_state_dict(first.state_dict())
    restored.load_history_state(first.history_state())
    assert [_step(restored, b) for b in batches[4:]] == expected[4:]
    assert torch.equal(restored._mch_sorted_raw_ids, unbroken._mch_sorted_raw_ids)
    buffers_only = _rows(policy=policy)
    buffers_only.load_state_dict(first.state_dict())
    assert [_step(buffers_only, b) for b in batches[4:]] != expected[4:]


def test_evaluation_looks_up_without_counting():
    module = _rows(interval=1)
    _step(module, [5, 6, 7])
    before = {k: v.clone() for k, v in module.state_dict().items()}
    module.eval()
    assert _step(module, [5, 9, 9, 9]) == _step(module, [5, 9, 9, 9])
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_an_unsharded_copy_of_two_shards_keeps_each_shards_shared_row():
    """A 2-rank checkpoint loaded into one module (export): an id found has its row; one not
    found takes the shared (last) row of the shard whose slice of the id space holds it."""
    shards = [
        _rows(n=4, output_global_offset=4 * k, output_segments=[0, 4, 8], buckets=2, interval=1) for k in range(2)
    ]
    _step(shards[0], [3, 5])  # ids of the lower half of [0, 2^40)
    _step(shards[1], [SPACE - 2])  # of the upper half
    state = {
        k: torch.cat([shards[0].state_dict()[k], shards[1].state_dict()[k]])
        for k in ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_last_access_iter")
    }
    whole = _rows(n=8)
    whole.load_state_dict({**shards[0].state_dict(), **state})
    whole.eval()
    expected = [_step(shards[0], [3])[0], _step(shards[1], [SPACE - 2])[0], 3, 7]  # 2 ids, 2 misses
    assert _step(whole, [3, SPACE - 2, 11, SPACE - 9]) == expected
    miss, block = whole.shard_miss_rows()
    assert miss.tolist() == [3, 7] and block == SPACE // 2
    remap = RawIdRemap(whole)  # what an exported program runs
    assert remap(torch.tensor([3, SPACE - 2, 11, SPACE - 9])).tolist() == expected


def test_remap_raw_ids_is_torchrecs_remap_for_one_shard():
    module = _rows(n=6, interval=1)
    _step(module, [40, 10, 30])
    module.eval()
    ids = torch.tensor([10, 20, 30, 40, 50])
    miss, block = module.shard_miss_rows()
    got = remap_raw_ids(ids, module._mch_sorted_raw_ids, module._mch_remapped_ids_mapping, miss, block)
    assert got.tolist() == _step(module, ids.tolist()) and got[1] == got[4] == 5


def test_a_split_collection_keeps_plain_tables_plain():
    configs = [
        EmbeddingBagConfig(name=f"{f}_table", embedding_dim=4, num_embeddings=10, feature_names=[f]) for f in "abc"
    ]
    managed = {"b": ManagedFeature(ManagedIds(), "data.columns.sparse.b", "data.columns.sparse.b.num_embeddings")}
    split = split_bag_collection(configs, managed)
    assert isinstance(split, SplitBagCollection) and isinstance(split.managed, ManagedCollisionEmbeddingBagCollection)
    assert [c.name for c in split.plain.embedding_bag_configs()] == ["a_table", "c_table"]
    assert [c.name for c in split.embedding_bag_configs()] == ["a_table", "c_table", "b_table"]
    assert type(split_bag_collection(configs, {})).__name__ == "EmbeddingBagCollection"


def test_the_managed_sharders_offer_row_wise_on_both_devices_and_only_the_fused_kernel_on_the_cpu():
    bags, sequences = ManagedBagSharder(), ManagedSequenceSharder()
    assert bags.sharding_types("cpu") == ["row_wise"] == bags.sharding_types("cuda")  # torchrec's: none on the CPU
    assert sequences.sharding_types("cpu") == ["row_wise"]
    assert bags.compute_kernels("row_wise", "cpu") == ["fused"] == sequences.compute_kernels("row_wise", "cpu")
    assert len(bags.compute_kernels("row_wise", "cuda")) > 1


def test_managed_ids_of_the_data_and_of_preprocess_agree():
    """Strings are hashed into the raw id space by training's reader and by `preprocess.py`
    alike; integers pass as they are, and one outside the space is refused by both."""
    strings = ["u1", "user-2", "", "ü"]
    record = {"mapping": "managed", "num_embeddings": 100, "input_hash_size": 1000}
    assert preprocess.map_ids(strings, record).tolist() == managed_string_ids(pa.array(strings), 1000).tolist()
    assert preprocess.map_ids(np.array([0, 999]), record).tolist() == [0, 999]
    with pytest.raises(ValueError, match=r"raw id 1000 is outside \[0, input_hash_size=1000\)"):
        preprocess.map_ids(np.array([5, 1000]), record)
    spread = spread_ids(np.arange(1000), 3, 2**32)
    assert len(set(spread.tolist())) == 1000 and spread.max() < 2**32 and spread.min() >= 0


def _parquet(tmp_path, ids, name="t.parquet"):
    table = pa.table({"label": np.zeros(len(ids), np.float32), "d": np.zeros(len(ids), np.float32), "u": ids})
    pq.write_table(table, tmp_path / name, row_group_size=4)
    return str(tmp_path / name)


def _columns(path: str, **managed) -> list[str]:
    item = "{num_embeddings:8,ids:managed" + "".join(f",managed:{{{k}:{v}}}" for k, v in managed.items()) + "}"
    return [
        "model=dlrm",
        "data=parquet",
        f"data.path={path}",
        "data.batch_size=4",
        f"data.columns={{labels:[label],dense:[d],sparse:{{u:{item}}}}}",
        "model.sharding=row_wise",
    ]


#: (id, overrides for tmp, WORLD_SIZE, config path of the error, message fragment)
REFUSED = [
    (
        "unknown eviction policy",
        lambda tmp: ["model=dlrm", "data.ids=managed", "data.managed.eviction_policy=lfx"],
        1,
        "data.managed.eviction_policy",
        "Input should be 'lfu', 'lru' or 'distance_lfu'",
    ),
    (
        "a shard of one row",
        lambda tmp: ["model=dlrm", "data.ids=managed", "model.sharding=row_wise", "data.num_embeddings=3"],
        2,
        "data.num_embeddings",
        "split over 2 rank(s) into shards of [2, 1] rows",
    ),
    (
        "plain torch tables",
        lambda tmp: ["model=dlrm_torch", "data.ids=managed"],
        1,
        "data.ids",
        "model 'dlrm_torch' has plain torch tables",
    ),
    (
        "a model without managed tables",
        lambda tmp: [
            "model=custom",
            "model.builder=custom_components:build_model",  # plain EmbeddingBagCollection tables
            "data=criteo_synthetic",
            "data.ids=managed",
            "model.sharding=row_wise",
        ],
        1,
        "data.ids",
        "the model builds no managed-collision table for it",
    ),
    (
        "the dense kernel",
        lambda tmp: ["model=dlrm", "data.ids=managed", "model.sharding=row_wise", "model.compute_kernel=dense"],
        1,
        "model.compute_kernel",
        "dense is not offered for managed-collision tables",
    ),
    (
        "table_wise",
        lambda tmp: ["model=dlrm", "data.ids=managed"],
        1,
        "model.sharding",
        "table_wise is not offered for table 'cat_0_table'",
    ),
    (
        "a raw id outside input_hash_size, in the statistics",
        lambda tmp: _columns(_parquet(tmp, np.arange(16) * 100), input_hash_size=1500),
        1,
        "data.path",
        "row group 3, column 'u': raw id 1500 is outside [0, input_hash_size=1500) with ids=managed",
    ),
    (
        "a retrieval file's raw item id outside input_hash_size",
        lambda tmp: [*_user_items(tmp / "users.txt"), "data.managed.input_hash_size=1000"],
        1,
        "data.path",
        "users.txt: item: raw id 1000 is outside [0, input_hash_size=1000) with ids=managed",
    ),
    (
        "a sequence Parquet vocabulary outside input_hash_size",
        lambda tmp: [*_user_items(tmp / "users.parquet"), "data.managed.input_hash_size=1000"],
        1,
        "data.path",
        "item: raw id 1000 is outside [0, input_hash_size=1000) with ids=managed",
    ),
    (
        "a user table for a retrieval model",
        lambda tmp: [*_user_items(tmp / "users.parquet"), "data.user_rows=10"],
        1,
        "data.user_rows",
        "the retrieval models have no user table",
    ),
    (
        "a negative raw id",
        lambda tmp: _columns(_parquet(tmp, np.arange(16) - 3)),
        1,
        "data.path",
        "raw id -3 is outside [0, input_hash_size=9223372036854775807)",
    ),
]


def _user_items(path, texts: bool = False) -> list[str]:
    """SASRec with managed item ids on 30 users' items 0, 50, ..., 1450 (texts `i<id>` with
    `texts`), as "user item" lines or, for a `.parquet` path, sequence Parquet with a vocabulary."""
    users = np.repeat(np.arange(30), 6)
    items = (np.arange(180) * 7 % 30) * 50
    if path.suffix == ".parquet":
        from recsys_pipe.data.parquet.decode import item_vocab_metadata

        lists = pa.array([items[u * 6 : u * 6 + 6].tolist() for u in range(30)], pa.list_(pa.int64()))
        table = pa.table({"user_id": np.arange(30), "item_ids": lists}).replace_schema_metadata(
            item_vocab_metadata(items)
        )
        pq.write_table(table, path)
        source = "parquet_sequences"
    else:
        path.write_text("".join(f"{u} {'i' if texts else ''}{i}\n" for u, i in zip(users, items, strict=True)))
        source = "sequences"
    return [
        "model=sasrec",
        f"data={source}",
        f"data.path={path}",
        "data.ids=managed",
        "data.item_rows=8",
        "data.eval_negatives=5",
        "data.batch_size=8",
    ]


def test_retrieval_text_ids_are_hashed_into_the_space_and_the_catalogue_served(tmp_path):
    """data=sequences with text item ids: the batches carry each text's FNV-1a into the space,
    and the export's item record holds the catalogue as the file has it."""
    from recsys_pipe.data import RankData
    from recsys_pipe.testing import load_run

    run = load_run(*_user_items(tmp_path / "users.txt", texts=True), "data.managed.input_hash_size=1000")
    data = RankData(run.data, 0, 1)
    names = sorted({f"i{i}" for i in (np.arange(180) * 7 % 30) * 50})
    raw = managed_string_ids(pa.array(names), 1000)
    batch = next(iter(data.train_loader()))
    assert set(batch.sparse_features["item"].values().tolist()) <= set(raw.tolist())
    assert set(batch.sparse_features["neg"].values().tolist()) <= set(raw.tolist())
    record = data.dataset.serving_features()["features"]["item"]["ids"]
    assert record == {
        "mapping": "managed",
        "num_embeddings": 8,
        "input_hash_size": 1000,
        "strings": "fnv1a64",
        "catalogue": names,
    }
    features = {"features": {"item": {"column": "item_ids", "parse": "id", "ids": record}}}
    assert preprocess.item_rows(["i50", "i0", "nope"], features).tolist() == [names.index("i50"), 0, -1]
    assert preprocess.item_ids([1, 0], features).tolist() == [names[1], names[0]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, overrides, world, path, fragment", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_in_one_line_before_anything_starts(
    name, overrides, world, path, fragment, tmp_path, capsys, monkeypatch, no_process_group
):
    """As scripts/train.sh checks before torchrun (`--check` with its WORLD_SIZE)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    argv = ["--check", *overrides(tmp_path), "trainer.device=cpu", f"trainer.output_dir={tmp_path}/runs"]
    assert train_cli.run(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: ") and fragment in lines[0], lines


def test_string_ids_are_hashed_into_the_id_space_and_pass(tmp_path, capsys, no_process_group):
    path = _parquet(tmp_path, np.array([f"user-{i}" for i in range(16)]))
    argv = [
        "--check",
        *_columns(path, input_hash_size=1000),
        "trainer.eval_batches=1",
        f"trainer.output_dir={tmp_path}",
    ]
    assert train_cli.run(argv) == 0, capsys.readouterr().err


def test_a_managed_sequence_table_is_an_embedding_collection_with_managed_rows():
    from recsys_pipe.models.managed import SplitCollection, split_collection

    configs = [EmbeddingConfig(name=f"{f}_table", embedding_dim=4, num_embeddings=6, feature_names=[f]) for f in "ab"]
    managed = {"a": ManagedFeature(ManagedIds(eviction_policy="distance_lfu"), "data", "data.item_rows")}
    split = split_collection(configs, managed)
    assert isinstance(split, SplitCollection)
    (rows,) = split.managed._managed_collision_collection._managed_collision_modules.values()
    assert isinstance(rows, ManagedRows) and type(rows._eviction_policy).__name__ == "DistanceLFU_EvictionPolicy"


def test_a_criteo_file_id_outside_the_32_bit_space_is_refused_at_its_line(tmp_path):
    from recsys_pipe.config import ConfigError
    from recsys_pipe.data.in_memory.criteo import CriteoDataConfig, CriteoDataset

    row = ["1", *["3"] * 13, *["0a1b2c3d"] * 26]
    wide = [*row[:14], "1ffffffff", *row[15:]]  # 33 bits
    path = tmp_path / "day.tsv"
    path.write_text("\n".join("\t".join(r) for r in (row, row, wide)) + "\n")
    CriteoDataset(CriteoDataConfig(path=str(tmp_path / "day.tsv"), ids="managed", max_rows=2))
    with pytest.raises(ConfigError) as caught:
        CriteoDataset(CriteoDataConfig(path=str(path), ids="managed"))
    assert str(caught.value).startswith(
        f"data.path: {path}:3: raw id 8589934591 is outside [0, input_hash_size=4294967296)"
    )
