"""Embedding sharding: hand-built plans on the real topology, torchrec's planner with per-table
constraints, the CPU refusals, a planner failure on 2 ranks (no hang), recsys-plan's printout."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsys_pipe.cli.plan import run as plan_cli
from recsys_pipe.config import ConfigError
from recsys_pipe.data import CriteoSyntheticDataConfig, SyntheticDataConfig
from recsys_pipe.models import DLRMConfig, HSTUConfig
from recsys_pipe.models.sharding import local_world_size, optimize_tables_in_backward, sharding_plan

BIN = Path(sys.executable).parent


def _meta(cfg, data):
    spec = data.spec()
    with torch.device("meta"):
        model = cfg.build(spec)
    optimize_tables_in_backward(model)
    return model


def _placements(plan) -> dict[str, list[str]]:
    """table -> the placement of each of its shards, from torchrec's printout."""
    out: dict[str, list[str]] = {}
    for line in str(plan).splitlines():
        match = re.match(r"(\w+_table)\s+\|\s+\[.*\]\s+\|\s+\[.*\]\s+\|\s+(\S+)", line)
        if match:
            out.setdefault(match[1], []).append(match[2])
    return out


def test_hand_built_plans_use_the_ranks_per_host(monkeypatch):
    """4 ranks on 2 hosts of 2: rank 3 is the second device of its host (the plan used to assume
    one host, `local_size=world_size`)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_world_size(4) == 2
    model = _meta(HSTUConfig(sharding="row_wise"), SyntheticDataConfig())
    plan = sharding_plan(model, HSTUConfig(sharding="row_wise"), 4, "cuda")
    assert _placements(plan)["item_table"] == ["rank:0/cuda:0", "rank:1/cuda:1", "rank:2/cuda:0", "rank:3/cuda:1"]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert local_world_size(4) == 4  # not started by torchrun: one host


def test_table_wise_round_robins_over_all_tables():
    model = _meta(DLRMConfig(), CriteoSyntheticDataConfig(num_embeddings=10))
    plan = sharding_plan(model, DLRMConfig(), 3, "cpu")
    ranks = [int(p[0].split(":")[1].split("/")[0]) for p in _placements(plan).values()]
    assert ranks == [i % 3 for i in range(26)]


def test_planner_honours_constraints_and_keeps_data_parallel_off_cpu_embedding_collections():
    cfg = HSTUConfig(sharding="planner", sharding_constraints={"action_table": ["table_wise"]})
    plan = str(sharding_plan(_meta(cfg, SyntheticDataConfig()), cfg, 2, "cpu"))
    assert re.search(r"action_table\s+\|\s+table_wise", plan)
    assert "data_parallel" not in plan


@pytest.mark.parametrize(
    "constraints, path, fragment",
    [
        ({"nope_table": ["row_wise"]}, "model.sharding_constraints.nope_table", "no table 'nope_table' in the model"),
        ({"item_table": ["data_parallel"]}, "model.sharding_constraints.item_table", "data_parallel does not work for"),
    ],
)
def test_planner_config_errors_name_the_table(constraints, path, fragment):
    cfg = HSTUConfig(sharding="planner", sharding_constraints=constraints)
    with pytest.raises(ConfigError) as info:
        sharding_plan(_meta(cfg, SyntheticDataConfig()), cfg, 2, "cpu")
    assert info.value.paths == [path] and fragment in str(info.value)


#: tables far over what 2 ranks' memory holds (built on the meta device, planned, never allocated)
TOO_BIG = 2_000_000_000


def test_planner_failure_and_unsupported_hand_plans_are_config_errors():
    data = CriteoSyntheticDataConfig(num_embeddings=TOO_BIG)
    cfg = DLRMConfig(sharding="planner")
    with pytest.raises(ConfigError) as info:
        sharding_plan(_meta(cfg, data), cfg, 2, "cpu")
    assert info.value.paths == ["model.sharding"] and "torchrec's planner found no plan" in str(info.value)
    small = CriteoSyntheticDataConfig(num_embeddings=10)
    with pytest.raises(ConfigError, match="table_row_wise splits each table over the ranks of one host and needs 2"):
        sharding_plan(_meta(DLRMConfig(), small), DLRMConfig(sharding="table_row_wise"), 4, "cpu", local_size=4)
    hstu = HSTUConfig(sharding="table_column_wise")
    with pytest.raises(ConfigError) as info:
        sharding_plan(_meta(hstu, SyntheticDataConfig()), hstu, 4, "cpu", local_size=2)
    assert info.value.paths == ["model.sharding"]
    assert (
        "table_column_wise is not offered for table 'item_table' (module 'ec', EmbeddingCollection) by "
        "EmbeddingCollectionSharder on cpu; it offers data_parallel, table_wise, column_wise, row_wise"
    ) in str(info.value)
    with pytest.raises(ValueError, match="sharding_constraints are used by torchrec's planner only"):
        HSTUConfig(sharding_constraints={"item_table": ["row_wise"]})


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_planner_failure_stops_every_rank_with_its_message(tmp_path):
    """torchrec's collective_plan would plan on rank 0 and leave rank 1 waiting in the broadcast.
    Here every rank plans for itself, so both fail alike: each exits 2 by itself with the
    planner's message. The ranks are started as two plain processes (env://), not by torchrun,
    which would kill the second rank as soon as the first one exits."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        argv = [
            str(BIN / "recsys-train"),
            "model=dlrm",
            "model.sharding=planner",
            f"data.num_embeddings={TOO_BIG}",
            "trainer=smoke",
            f"trainer.output_dir={tmp_path}",
        ]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        results = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 2, err[-3000:]
        (line,) = [x for x in err.splitlines() if x.startswith("error: model.sharding: torchrec's planner found no")]
        assert "insufficient storage" in line
        assert "Traceback" not in err


def test_recsys_plan_shows_torchrecs_sharding_plan(tmp_path, capsys):
    code = plan_cli(["model=dlrm", "model.sharding=planner", "world_size=2", f"hydra.run.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0
    assert (
        "model: dlrm (torchrec tables, model.sharding=planner; sharding plan for 2 rank(s), 2 per host, on cpu)" in out
    )
    assert "module: model.sparse_arch.embedding_bag_collection" in out and "sharding type" in out
    assert (tmp_path / "model.txt").read_text() in out
    assert "model:" not in (tmp_path / "plan.txt").read_text()  # the task graph text stays as it was


def test_recsys_plan_says_which_tasks_a_plain_torch_model_leaves_idle(tmp_path, capsys):
    assert plan_cli(["model=dlrm_torch", "pipeline=hstu_prefetch", f"hydra.run.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "model: dlrm_torch (plain torch tables, replicated on every rank under DDP)" in out
    idle = re.findall(r"^  (\w+): the model has no torchrec-sharded tables", out, re.M)
    assert idle == ["start_input_dist", "wait_input_dist", "prefetch_embeddings"]


def test_recsys_plan_refuses_a_failing_planner_with_exit_2(tmp_path, capsys):
    code = plan_cli(
        [
            "model=dlrm",
            "model.sharding=planner",
            f"data.num_embeddings={TOO_BIG}",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "error: model.sharding: torchrec's planner found no plan" in err and "storage" in err
