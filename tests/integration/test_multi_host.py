"""The multi-host scenario's subset for the suite (the whole set, 8 ranks as two torchrun agents of
4: `recsys-bench multi_host`). 4 ranks as 2 hosts x 2 (`LOCAL_WORLD_SIZE=2`, ranks forked by
`fork_ranks`): DLRM with every sharding type and HSTU ranking with every type its sequence tables
offer, each against one rank on the same global batches; a `data=parquet` run broken as 4 ranks
`row_wise` -> 2 ranks `table_row_wise` (2 hosts x 1) -> 1 rank, its tables on the dense kernel
(Adam's moments of the table rows are sharded state), against the run unbroken; and rank 0's
planner plan used by every rank. Ranks forked from one process share Python's hash seed, so the
planners' tie-breaks agree here; the scenario's two agents do not (the plan broadcast's reason).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recsys_pipe.bench import multi_host_worker
from recsys_pipe.testing import check_torchrun, fork_ranks, read_rank_results

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORKER = Path(multi_host_worker.__file__)
TESTS = Path(__file__).resolve().parents[1]
STEPS = 6
DLRM = ["table_wise", "row_wise", "column_wise", "table_column_wise", "table_row_wise", "planner"]
HSTU = ["table_wise", "row_wise", "column_wise", "planner/item_table=column_wise"]
RTOL = 1e-5


def _ranks(*args: str, nproc: int, per_host: int) -> None:
    check_torchrun(fork_ranks(WORKER, *args, nproc=nproc, timeout=400, env={"LOCAL_WORLD_SIZE": str(per_host)}))


def _rel(values: list[float], reference: list[float]) -> float:
    assert len(values) == len(reference) and len(set(reference)) > 1
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference))


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("multi_host_parity")
    _ranks("sharded", str(out), str(STEPS), f"dlrm:{','.join(DLRM)}", f"hstu:{','.join(HSTU)}", nproc=4, per_host=2)
    _ranks("one_rank", str(out), "4", "dlrm", "hstu", nproc=1, per_host=1)
    return out


@pytest.mark.parametrize("case, variants", [("dlrm", DLRM), ("hstu", HSTU)])
def test_every_sharding_type_on_2_hosts_trains_like_one_rank(parity, case, variants):
    reference = json.loads((parity / f"{case}_one_rank.json").read_text())["losses"]
    ranks = [json.loads((parity / f"{case}_rank{r}.json").read_text()) for r in range(4)]
    assert list(ranks[0]) == variants and len(reference) == STEPS
    for name in variants:
        assert all(rank[name]["losses"] == ranks[0][name]["losses"] for rank in ranks)
        assert _rel(ranks[0][name]["losses"], reference) < RTOL, name
        forced = name.split("=")[-1] if "=" in name else name
        if forced != "planner":  # the plan printed by the trained model has the type asked for
            assert f"| {forced} " in ranks[0][name]["plan"], ranks[0][name]["plan"]


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("multi_host_reshard")
    legs = [("r4", 2, 2, "row_wise", 10), ("r2", 2, 1, "table_row_wise", 20), ("r1", 1, 1, "table_wise", 30)]
    previous: list[str] = []
    for name, hosts, per_host, sharding, until in legs:
        _ranks(
            "leg",
            str(out),
            name,
            "16",
            str(until),
            sharding,
            *previous[-1:],
            "dense",
            nproc=hosts * per_host,
            per_host=per_host,
        )
        previous.append(name)
    _ranks("unbroken", str(out), "unbroken", *previous, "dense", nproc=1, per_host=1)
    return out, [(name, hosts * per_host) for name, hosts, per_host, _, _ in legs]


def test_a_run_resharded_across_world_sizes_and_types_continues_the_unbroken_run(broken_run):
    out, legs = broken_run
    records = {name: [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(n)] for name, n in legs}
    assert [records[name][0]["start"] for name, _ in legs] == [0, 10, 20]
    losses = [x for name, _ in legs for x in records[name][0]["losses"]]
    unbroken = json.loads((out / "unbroken_rank0.json").read_text())["losses"]
    assert len(losses) == 30 and _rel(losses, unbroken) < RTOL
    end, whole = torch.load(out / "r1_state.pt"), torch.load(out / "unbroken_state.pt")
    assert sorted(end) == sorted(whole) and sum(k.endswith("exp_avg_sq") for k in whole) == 26
    for key, value in whole.items():  # the tables and Adam's moments of their rows
        torch.testing.assert_close(end[key], value, rtol=1e-4, atol=1e-4 * float(value.abs().max()), msg=key)
    trained = [i for ranks in records.values() for rank in ranks for step in rank["sample_ids"] for i in step]
    assert records["r4"][0]["batches_per_epoch"] == 30
    assert len(trained) == len(set(trained)) == 30 * 16  # every row of the epoch once


def test_every_rank_shards_by_rank_0s_planner_plan(tmp_path):
    check_torchrun(fork_ranks(TESTS / "dist" / "plan_broadcast_worker.py", str(tmp_path), nproc=2, timeout=300))
    ranks = read_rank_results(tmp_path, 2)
    assert ranks[0]["own"] != ranks[1]["own"]  # the planners disagreed
    assert ranks[0]["used"] == ranks[1]["used"] == ranks[0]["own"]
