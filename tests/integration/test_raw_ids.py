"""Managed-collision tables (`ids: managed`, docs/raw-ids.md) through every shipped plan, a
resume and an evaluation, on 1 and 2 forked ranks (gloo, CPU): `tests/dist/raw_ids_worker.py`.

Tolerance: bitwise, as in test_train_parity: on the CPU every plan performs the same operations
in the same order on the same batches, the remapping and the evictions included.
"""

import json
from pathlib import Path

import pytest

from recsys_pipe.testing import fork_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist" / "raw_ids_worker.py"


def _launch(out: Path, nproc: int, *parts: str) -> list[dict]:
    proc = fork_ranks(WORKER, str(out), *parts, nproc=nproc, timeout=500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("raw_ids2"), 2, "plans", "resume", "eval")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("raw_ids1"), 1, "plans")


@pytest.fixture(params=["one_rank", "two_ranks"])
def ranks(request):
    return request.getfixturevalue(request.param)


def test_every_plan_trains_the_serial_plans_numbers_with_managed_tables(ranks):
    """Per-step losses, trained batches and every local tensor (dense weights, table shards and
    the remapping with its counts or ages) equal the serial plan's (or, for the balanced plans,
    the balanced serial plan's) while ids are evicted."""
    for data in ranks:
        plans = data["plans"]
        for name, got in plans.items():
            reference = got.get("reference")
            if reference is None or name.startswith("stale/"):
                continue
            ref = plans[reference]
            assert got["losses"] == ref["losses"], f"{name}: losses differ from {reference}"
            assert got["sample_ids"] == ref["sample_ids"], f"{name}: trained other batches"
            assert got["params"] == ref["params"], f"{name}: final tensors differ from {reference}"
            assert got["evicted_rows"] > 0, f"{name}: no row was re-initialised: the tables evicted nothing"
        assert len(plans["dlrm/serial"]["losses"]) == 8 and len(plans["dlrm/serial"]["params"]) > 20


def test_semi_synchronous_plans_match_the_stale_embedding_loop(ranks):
    """semi_sync and semi_sync_stash look batch i up in the tables from before batch i-1's update;
    with tables that admit every id (no row a batch updated is re-initialised by the next one's
    lookup), they equal the plain loop of that staleness bitwise. With evicting tables their two
    executors agree (test above) and differ from the serial plan (the staleness is real)."""
    for data in ranks:
        plans = data["plans"]
        for name in ("stale/semi_sync", "stale/semi_sync_stash"):
            ref = plans[plans[name]["reference"]]
            assert plans[name]["losses"] == ref["losses"], name
            assert plans[name]["sample_ids"] == ref["sample_ids"], name
            assert plans[name]["params"] == ref["params"], name
        assert plans["hstu/semi_sync"]["losses"][1:] != plans["hstu/serial"]["losses"][1:]


def test_resume_mid_eviction_interval_is_bitwise_the_unbroken_run(two_ranks):
    """Resumed from step 4 of an eviction interval of 3 (ids counted since the eviction at step
    3 are in the rank's own checkpoint file): steps 5-8 and every final tensor equal the unbroken
    run's, for serial, pipelined and semi-synchronous plans. Without those counted ids (the
    control) the run differs: the test is not vacuous."""
    for data in two_ranks:
        for name, got in data["resume"].items():
            unbroken, resumed = got["unbroken"], got["resumed"]
            assert resumed["losses"] == unbroken["losses"][4:], f"{name}: losses"
            assert resumed["sample_ids"] == unbroken["sample_ids"][4:], f"{name}: batches"
            assert resumed["params"] == unbroken["params"], f"{name}: final tensors"
            assert got["control"]["params"] != unbroken["params"], f"{name}: the control resume changed nothing"


def test_evaluation_looks_ids_up_without_counting_or_evicting(two_ranks):
    for data in two_ranks:
        assert data["evaluation"]["changed"] == [] and data["evaluation"]["tensors"] > 20


def test_each_rank_remaps_the_raw_ids_of_its_slice_of_the_id_space(two_ranks):
    """Row-wise: rank r's shard holds raw ids of the r-th half of [0, input_hash_size) only, in
    the r-th half of the rows (the remapping runs on the rank that owns the ids, after the
    input all-to-all, as torchrec's sharded module runs it)."""
    for rank, data in enumerate(two_ranks):
        layout = data["layout"]
        assert layout["ids"] and all(rank * layout["block"] <= i < (rank + 1) * layout["block"] for i in layout["ids"])
        assert layout["offset"] == rank * 12  # 24 rows, 12 per rank
