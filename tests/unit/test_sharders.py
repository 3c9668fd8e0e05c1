"""The project's sharders (what each offers on which device, `offered_on_cpu`) and the hand-built
plans of every sharding type, made on the meta device for several topologies; the refusals of
a type a table's sharder does not offer and of `table_row_wise` on one host."""

from __future__ import annotations

import re

import pytest
import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from recsys_pipe.config import ConfigError
from recsys_pipe.data import CriteoSyntheticDataConfig, SyntheticDataConfig
from recsys_pipe.models import DLRMConfig, HSTUConfig
from recsys_pipe.models.sharders import (
    SHARDERS,
    CpuEmbeddingBagCollectionSharder,
    ManagedBagSharder,
    ManagedSequenceSharder,
    offered_on_cpu,
    project_sharders,
    sharder_for,
)
from recsys_pipe.models.sharding import column_shards, optimize_tables_in_backward, sharding_plan
from recsys_pipe.train.parallel import Topology

DLRM_DATA = CriteoSyntheticDataConfig(num_embeddings=100)


def _meta(cfg, data):
    with torch.device("meta"):
        model = cfg.build(data.spec())
    optimize_tables_in_backward(model)
    return model


def _shards(plan) -> dict[str, list[tuple[str, str, str, str]]]:
    """table -> (sharding type, offsets, sizes, placement) of each shard, from torchrec's printout."""
    types = dict(re.findall(r"^(\w+_table)\s+\|\s+(\w+)\s+\|", str(plan), re.M))
    out: dict[str, list[tuple[str, str, str, str]]] = {}
    for name, offsets, sizes, placement in re.findall(
        r"^(\w+_table)\s+\|\s+(\[[\d, ]+\])\s+\|\s+(\[[\d, ]+\])\s+\|\s+(\S+)", str(plan), re.M
    ):
        out.setdefault(name, []).append((types[name], offsets, sizes, placement))
    return out


def test_the_bag_sharder_offers_on_the_cpu_what_the_cpu_can_run():
    ours, torchrecs = CpuEmbeddingBagCollectionSharder(), EmbeddingBagCollectionSharder()
    assert isinstance(ours, EmbeddingBagCollectionSharder) and ours.module_type is EmbeddingBagCollection
    assert set(torchrecs.sharding_types("cpu")) == {"data_parallel", "table_wise", "column_wise", "table_column_wise"}
    assert ours.sharding_types("cpu") == [*torchrecs.sharding_types("cpu"), "row_wise", "table_row_wise"]
    assert ours.sharding_types("cuda") == torchrecs.sharding_types("cuda")  # grid_shard stays CUDA's
    assert SHARDERS[EmbeddingCollection] is EmbeddingCollectionSharder  # sequence tables: torchrec's as they are


def test_offered_on_cpu_is_one_mechanism_for_any_sharder():
    cls = offered_on_cpu(EmbeddingCollectionSharder, ["table_row_wise"])
    assert issubclass(cls, EmbeddingCollectionSharder) and cls.__name__ == "CpuEmbeddingCollectionSharder"
    assert cls().sharding_types("cpu")[-1] == "table_row_wise" and "table_row_wise" not in cls().sharding_types("cuda")

    class MyBags(EmbeddingBagCollection):
        pass

    bags = MyBags(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=3, feature_names=["f"])])
    assert isinstance(sharder_for(bags), CpuEmbeddingBagCollectionSharder)  # the most specific class in SHARDERS
    assert {type(s) for s in project_sharders()} == {
        CpuEmbeddingBagCollectionSharder,
        EmbeddingCollectionSharder,
        ManagedBagSharder,
        ManagedSequenceSharder,
    }
    with pytest.raises(TypeError, match="no sharder for Linear"):
        sharder_for(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("dim, ranks, shards", [(16, 8, 4), (16, 2, 2), (32, 4, 4), (6, 4, 1), (12, 8, 3)])
def test_column_shards_are_multiples_of_4_wide(dim, ranks, shards):
    assert column_shards(dim, ranks) == shards


def test_every_hand_built_type_on_2_hosts_of_4():
    """DLRM's 26 tables (16 wide) on 8 ranks as 2 hosts x 4, on the CPU."""
    model = _meta(DLRMConfig(), DLRM_DATA)

    def shards(kind: str) -> dict[str, list[tuple[str, str, str, str]]]:
        return _shards(sharding_plan(model, DLRMConfig(sharding=kind), 8, "cpu", local_size=4))

    table_wise = shards("table_wise")
    assert [s[0][3] for s in table_wise.values()] == [f"rank:{i % 8}/cpu" for i in range(26)]
    rows = shards("row_wise")["cat_3_table"]
    assert [s[1] for s in rows] == [f"[{13 * r}, 0]" for r in range(7)] + ["[91, 0]"] and len(rows) == 8
    cols = shards("column_wise")  # 4 shards of 4 columns on consecutive ranks, table i from rank 4i
    assert cols["cat_1_table"] == [("column_wise", f"[0, {4 * j}]", "[100, 4]", f"rank:{4 + j}/cpu") for j in range(4)]
    assert [s[3] for s in cols["cat_2_table"]] == [f"rank:{r}/cpu" for r in range(4)]
    within = shards("table_column_wise")  # table i on host i % 2, its 4 columns on that host's ranks
    assert {s[0] for s in within["cat_0_table"]} == {"table_column_wise"}
    assert [s[3] for s in within["cat_1_table"]] == [f"rank:{r}/cpu" for r in (4, 5, 6, 7)]
    trw = shards("table_row_wise")  # table i split by rows over host i % 2
    assert [(s[0], s[3]) for s in trw["cat_5_table"]] == [("table_row_wise", f"rank:{r}/cpu") for r in (4, 5, 6, 7)]
    assert [s[1] for s in trw["cat_4_table"]] == ["[0, 0]", "[25, 0]", "[50, 0]", "[75, 0]"]


def test_sequence_tables_are_refused_the_types_their_sharder_does_not_offer():
    hstu = HSTUConfig(sharding="table_row_wise")
    with pytest.raises(ConfigError) as info:
        sharding_plan(_meta(hstu, SyntheticDataConfig()), hstu, 4, "cuda", local_size=2)
    assert info.value.paths == ["model.sharding"]
    assert str(info.value).startswith(
        "model.sharding: table_row_wise is not offered for table 'item_table' (module 'ec', EmbeddingCollection) by "
        "EmbeddingCollectionSharder on cuda"
    )
    planner = HSTUConfig(sharding="planner", sharding_constraints={"action_table": ["table_row_wise", "row_wise"]})
    with pytest.raises(ConfigError) as info:
        sharding_plan(_meta(planner, SyntheticDataConfig()), planner, 4, "cpu", local_size=2)
    assert info.value.paths == ["model.sharding_constraints.action_table"]
    assert "table_row_wise not offered for table 'action_table' (EmbeddingCollection)" in str(info.value)


@pytest.mark.parametrize(
    "cfg",
    [
        DLRMConfig(sharding="table_row_wise"),
        DLRMConfig(sharding="planner", sharding_constraints={"cat_0_table": ["table_row_wise"]}),
    ],
)
def test_table_row_wise_needs_two_hosts(cfg):
    model = _meta(cfg, DLRM_DATA)
    with pytest.raises(ConfigError, match="splits each table over the ranks of one host and needs 2 or more hosts"):
        sharding_plan(model, cfg, 4, "cpu", local_size=4)
    assert sharding_plan(model, cfg, 4, "cpu", local_size=2)  # 2 hosts of 2


def test_ranks_per_host_must_divide_the_ranks():
    Topology(8, 4, "cpu").check()
    with pytest.raises(ConfigError) as info:
        Topology(8, 3, "cpu", "local_world_size").check()
    assert info.value.paths == ["local_world_size"]
    assert "3 ranks per host do not divide the 8 ranks" in str(info.value)
