"""End-to-end training on 2 ranks (torchrun, gloo, CPU) for the other model paths: torchrec's
DLRM and DLRM_DCN, the plain-torch DLRM under DDP, torchrec's sharding planner, the balanced
batch shuffler, and the retrieval models (SASRec, HSTU retrieval). Within each group every plan
trains bitwise the same losses, batches and final parameters as the group's reference (serial,
or serial_balanced for the balanced plans); DLRM, and SASRec with its item table on the dense
kernel (Adam), also match torchrec's own TrainPipelineSparseDist. See test_train_parity for why
bitwise.
"""

from pathlib import Path

import pytest

from recsys_pipe.testing import check_torchrun, fork_ranks, read_rank_results

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

WORKER = Path(__file__).resolve().parents[1] / "dist" / "model_parity_worker.py"
SAME_AS_REFERENCE = [
    "dlrm",
    "dlrm_dcn",
    "dlrm_planner",
    "hstu_planner",
    "dlrm_torch",
    "balanced",
    "sasrec",
    "sasrec_dense",
    "hstu_retrieval",
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("model_parity")
    check_torchrun(fork_ranks(WORKER, str(out), timeout=350))
    return read_rank_results(out)


@pytest.mark.parametrize("group", SAME_AS_REFERENCE)
def test_every_plan_matches_its_reference_bitwise(ranks, group):
    for data in ranks:
        variants = data[group]["variants"]
        ref_name, ref = next(iter(variants.items()))
        assert len(ref["losses"]) == 10 and len(set(ref["losses"])) > 1
        assert len(variants) >= 2
        for name, variant in variants.items():
            assert variant["losses"] == ref["losses"], f"{group}/{name}: losses differ from {ref_name}"
            assert variant["params"] == ref["params"], f"{group}/{name}: parameters differ from {ref_name}"
            assert variant["sample_ids"] == ref["sample_ids"], f"{group}/{name}: trained other samples"


@pytest.mark.parametrize("group", ["dlrm", "sasrec_dense"])
def test_matches_torchrec_train_pipeline(ranks, group):
    for data in ranks:
        variants = data[group]["variants"]
        assert "torchrec_TrainPipelineSparseDist" in variants
        assert variants["torchrec_TrainPipelineSparseDist"]["losses"] == variants["serial"]["losses"]
        assert variants["torchrec_TrainPipelineSparseDist"]["params"] == variants["serial"]["params"]
        assert variants["serial"]["sample_ids"] == data[group]["loader_ids"]


def test_the_dense_kernel_trains_the_item_table_otherwise_than_the_fused_one(ranks):
    """Same batches, Adam on the table instead of fbgemm's fused update: other losses."""
    for data in ranks:
        assert data["sasrec_dense"]["variants"]["serial"]["losses"] != data["sasrec"]["variants"]["serial"]["losses"]


def test_unbalanced_groups_train_the_loaded_batches(ranks):
    for data in ranks:
        for group in ("dlrm", "dlrm_torch", "hstu_planner", "sasrec", "hstu_retrieval"):
            for variant in data[group]["variants"].values():
                assert variant["sample_ids"] == data[group]["loader_ids"]


def test_planner_plans_identically_on_every_rank_and_honours_constraints(ranks):
    for group in ("dlrm_planner", "hstu_planner"):
        plans = [data[group]["variants"]["serial"]["sharding_plan"] for data in ranks]
        assert plans[0] == plans[1]  # no collective was needed to agree
    dlrm_plan = ranks[0]["dlrm_planner"]["variants"]["serial"]["sharding_plan"]
    (cat_0,) = [line for line in dlrm_plan.splitlines() if line.startswith("cat_0_table ") and "|" in line][:1]
    assert "column_wise" in cat_0
    hstu_plan = ranks[0]["hstu_planner"]["variants"]["serial"]["sharding_plan"]
    assert "data_parallel" not in hstu_plan  # broken for EmbeddingCollection on CPU: never chosen


def test_balanced_plans_train_every_sample_exactly_once_and_even_out_the_work(ranks):
    """The shuffle exchanges samples between ranks: per step, the samples trained over both ranks
    are exactly the ones loaded over both ranks (none lost, none twice), each rank keeps its batch
    size, and the per-rank cost imbalance (max/mean) falls."""
    moved = 0
    for name, variant in ranks[0]["balanced"]["variants"].items():
        trained = [variant["sample_ids"], ranks[1]["balanced"]["variants"][name]["sample_ids"]]
        loaded = [data["balanced"]["loader_ids"] for data in ranks]
        for step in range(len(loaded[0])):
            assert sorted(trained[0][step] + trained[1][step]) == sorted(loaded[0][step] + loaded[1][step])
            assert len(trained[0][step]) == len(loaded[0][step]) == len(trained[1][step])
            moved += trained[0][step] != loaded[0][step]
        balance = variant["balance"]
        assert balance["batches"] == len(loaded[0]) - 1  # the first batch trains as loaded (model rewrite)
        assert balance["imbalance_after"] < balance["imbalance_before"]
    assert moved > 0  # the shuffle did move samples


def test_balancing_changes_what_each_rank_trains_but_not_the_global_step(ranks):
    for data in ranks:
        group = data["balanced_vs_loaded"]["variants"]
        assert group["serial"]["sample_ids"] == data["balanced_vs_loaded"]["loader_ids"]
        assert group["serial_balanced"]["sample_ids"] != group["serial"]["sample_ids"]
        assert group["serial_balanced"]["losses"][0] == group["serial"]["losses"][0]  # bootstrap batch: as loaded


def test_retrieval_evaluation_is_the_same_on_every_plan_and_covers_every_user(ranks):
    """The distributed evaluation after training: every plan gives the same ranking metrics (they
    come from the same weights), identical on both ranks (gathered), over every evaluated user."""
    for group in ("sasrec", "hstu_retrieval"):
        records = [v["eval"] for data in ranks for v in data[group]["variants"].values()]
        assert all(r == records[0] for r in records), group
        assert records[0]["users"] == {"valid": 400, "test": 400}  # every user of the file has >= 3 items
        assert 0 < records[0]["test"]["sampled"]["HR@10"] < 1
        assert records[0]["test"]["full"]["HR@200"] > records[0]["test"]["full"]["HR@10"]
