"""End-to-end training on 2 ranks (forked ranks, gloo, CPU): every plan trains the same numbers.

Tolerance: bitwise (torch.equal / identical floats). On CPU every kernel is deterministic and
every plan performs the same operations in the same order on the same batches, so any
difference would be a real scheduling bug (a batch trained twice, out of order, or against
weights of the wrong step), not floating-point noise.
"""

import json
from pathlib import Path

import pytest
import torch

from recsys_pipe.testing import fork_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    proc = fork_ranks(ROOT / "tests" / "dist" / "train_parity_worker.py", str(out), timeout=500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for data in ranks:  # the accumulation check's tables, saved as tensors
        for result in data["accumulate_vs_large_batch"].values():
            if isinstance(result, dict):
                result["params"] = torch.load(out / result["params"], weights_only=True)
    return ranks


def test_all_plans_and_torchrec_pipeline_match_serial_bitwise(ranks):
    for data in ranks:
        ref = data["variants"]["serial"]
        assert len(ref["losses"]) == 24
        for name, variant in data["variants"].items():
            if name.startswith(("global/", "ga4/", "ga5/", "stale/", "stash/", "warm/", "warmstash/", "ga4stale/")):
                continue
            assert variant["losses"] == ref["losses"], f"{name}: losses differ from the serial plan"
            assert variant["params"] == ref["params"], f"{name}: final parameters differ from the serial plan"
            assert variant["sample_ids"] == ref["sample_ids"], f"{name}: trained other batches"
        assert data["unchanged_by_training"] == [] and data["num_params"] > 10  # parity is not vacuous
    assert ranks[0]["variants"]["serial"]["losses"] != ranks[1]["variants"]["serial"]["losses"]  # disjoint data


def test_global_token_normalisation_matches_its_serial_plan_and_the_local_mean(ranks):
    """With the derived all-reduce task the plan with lookaheads still equals its serial plan bitwise;
    every rank has the same token count here, so the loss equals the local mean up to rounding
    (a different but equivalent formula: loss_sum * world / global_tokens)."""
    for data in ranks:
        ref = data["variants"]["global/serial"]
        got = data["variants"]["global/hstu_prefetch/threaded"]
        assert got["losses"] == ref["losses"] and got["params"] == ref["params"]
        assert got["sample_ids"] == data["loader_ids"]
        local = data["variants"]["serial"]["losses"]
        assert ref["losses"][0] == pytest.approx(local[0], rel=1e-6)  # same weights, same batch
        assert ref["losses"] != local  # and it is really the other formula
        assert ref["losses"] == pytest.approx(local, rel=1e-3)


def test_every_loader_batch_is_trained_exactly_once_in_order(ranks):
    for data in ranks:
        for name, variant in data["variants"].items():
            assert variant["sample_ids"] == data["loader_ids"], name
    ids = [i for data in ranks for batch in data["loader_ids"] for i in batch]
    assert len(ids) == len(set(ids))  # ranks read disjoint samples


def test_train_eval_switch_leaks_nothing_and_changes_nothing(ranks):
    for data in ranks:
        train_ids = {i for batch in data["loader_ids"] for i in batch}
        assert len(data["eval_ids"]) == 3
        assert not train_ids & {i for batch in data["eval_ids"] for i in batch}
        for plan, interleaved in data["interleaved"].items():
            trained_alone = data["variants"]["stale/semi_sync" if plan == "semi_sync" else "serial"]
            assert interleaved["losses"] == trained_alone["losses"], plan
            assert interleaved["sample_ids"] == data["loader_ids"], plan
            assert [e["step"] for e in interleaved["evals"]] == [0, 5, 10, 15, 20, 24], plan
            for evaluation in interleaved["evals"]:  # every output evaluated belongs to its batch, in order
                assert evaluation["sample_ids"] == data["eval_ids"], (plan, evaluation["step"])


def test_evaluation_inside_a_pipelined_run_equals_the_serial_plans(ranks):
    """With 3 batches in flight (hstu_prefetch), each evaluation between training steps gives
    the serial plan's metrics and per-batch losses, bitwise: no in-flight training batch is
    evaluated, no evaluated output is attributed to another batch. semi_sync trains other
    weights (stale embeddings), so its evaluations differ from the serial plan's after step 0."""
    for data in ranks:
        serial = data["interleaved"]["serial"]["evals"]
        assert data["interleaved"]["hstu_prefetch"]["evals"] == serial
        assert len({tuple(e["batch_losses"]) for e in serial}) == len(serial)  # the weights change
        semi_sync = data["interleaved"]["semi_sync"]["evals"]
        assert semi_sync[0] == serial[0]
        assert all(a["batch_losses"] != b["batch_losses"] for a, b in zip(semi_sync[1:], serial[1:]))


def test_learning_signal_auc_rises_on_held_out_data(ranks):
    first, last = ranks[0]["learning"]["evals"][0], ranks[0]["learning"]["evals"][-1]
    assert first["step"] == 0 and last["step"] == 80
    assert last["auc"] > first["auc"] + 0.1, (first, last)
    metrics = [
        [{k: v for k, v in e.items() if k not in ("sample_ids", "batch_losses")} for e in r["learning"]["evals"]]
        for r in ranks
    ]
    assert metrics[0] == metrics[1]  # metrics are global (the recorded batches are each rank's own)
    assert ranks[0]["learning"]["evals"][0]["sample_ids"] != ranks[1]["learning"]["evals"][0]["sample_ids"]
    learning = ranks[0]["learning"]
    assert sum(learning["last_losses"]) < sum(learning["first_losses"])


#: plan -> the torchrec class (and option) whose order of work it declares
FAMILY = {
    "sparse_dist": "torchrec_TrainPipelineSparseDist",
    "base": "torchrec_TrainPipelineBase",
    "sparse_dist_lite": "torchrec_TrainPipelineSparseDistLite",
    "sparse_dist_enqueue_after_forward": "torchrec_TrainPipelineSparseDist/enqueue_batch_after_forward",
    # same numbers as TrainPipelineSparseDist (torchrec's Fused class cannot run on the CPU:
    # tests/cuda/test_cuda_family.py compares with it)
    "fused_sparse_dist": "torchrec_TrainPipelineSparseDist",
    # h2d's options.inplace_copy against torchrec's enable_inplace_copy_batch
    "inplace/sparse_dist": "torchrec_TrainPipelineSparseDist/enable_inplace_copy_batch",
    "inplace/hstu_prefetch/threaded": "torchrec_TrainPipelineSparseDist/enable_inplace_copy_batch",
}


def test_each_family_plan_matches_its_torchrec_class_bitwise(ranks):
    """Per-step losses, trained sample ids and every final parameter (dense and each local
    embedding shard) of the plan equal those of torchrec's own class on the same batches."""
    for data in ranks:
        for plan_name, torchrec_name in FAMILY.items():
            plan, ref = data["variants"][plan_name], data["variants"][torchrec_name]
            assert len(ref["losses"]) == 24, torchrec_name
            assert plan["losses"] == ref["losses"], f"{plan_name} vs {torchrec_name}: losses"
            assert plan["sample_ids"] == ref["sample_ids"], f"{plan_name} vs {torchrec_name}: batches"
            assert plan["params"] == ref["params"], f"{plan_name} vs {torchrec_name}: final parameters"


def test_grad_accumulation_matches_torchrecs_wrapper_bitwise_on_every_plan(ranks):
    """trainer.grad_accumulation (4 micro-steps, 2 warmup; and 5, whose last window the 24
    batches leave open: torchrec's flush) on several plans and executors against torchrec's
    GradientAccumulationWrapper around TrainPipelineSparseDist: same losses, batches and final
    parameters, bitwise. And it really accumulates: the result differs from stepping every batch."""
    for data in ranks:
        variants = data["variants"]
        for window in ("ga4", "ga5"):
            ref = variants[f"{window}/torchrec_GradientAccumulationWrapper(TrainPipelineSparseDist)"]
            plans = [name for name in variants if name.startswith(f"{window}/") and "torchrec" not in name]
            assert plans
            for name in plans:
                assert variants[name]["losses"] == ref["losses"], f"{name}: losses"
                assert variants[name]["sample_ids"] == ref["sample_ids"], f"{name}: batches"
                assert variants[name]["params"] == ref["params"], f"{name}: final parameters"
            assert ref["losses"][0] == variants["serial"]["losses"][0]  # same first step
            assert ref["losses"] != variants["serial"]["losses"]
            assert ref["params"] != variants["serial"]["params"]
        assert variants["ga4/serial"]["params"] != variants["ga5/sparse_dist"]["params"]


def test_scaled_accumulation_equals_a_k_times_larger_batch_within_rounding(ranks):
    """Where the maths is the same (plain torch tables: every parameter dense; scale_loss: the
    step sees the mean over the window), accumulating k micro-batches equals one serial step on
    their concatenation, up to float rounding (the k partial sums round differently than one
    sum: not bitwise). Unscaled (torchrec's default) the gradients are k times larger. With
    torchrec tables the maths differs: their optimizer is fused into backward, so they are
    updated by every micro-batch (not checked for equality)."""
    for data in ranks:
        result = data["accumulate_vs_large_batch"]
        k, large, acc, summed = result["k"], result["large"], result["accumulated"], result["summed"]
        assert len(large["losses"]) * k == len(acc["losses"]) == 24
        window_means = [sum(acc["losses"][i : i + k]) / k for i in range(0, len(acc["losses"]), k)]
        assert window_means == pytest.approx(large["losses"], rel=1e-5)
        assert window_means != large["losses"]  # not bitwise: rounding differs
        for name, values in large["params"].items():
            assert _approx_equal(acc["params"][name], values), name
        assert not all(  # unscaled sums really differ: the tolerance above is not vacuous
            _approx_equal(summed["params"][n], v) for n, v in large["params"].items()
        )


def _approx_equal(got: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4, abs_: float = 1e-6) -> bool:
    """pytest.approx(expected, rel=rel, abs=abs_) == got, element-wise on tensors (in float64, as
    approx compares Python floats): |got - expected| <= max(rel * |expected|, abs_), NaN unequal."""
    got, expected = got.double(), expected.double()
    tolerance = torch.clamp(expected.abs() * rel, min=abs_)
    return got.shape == expected.shape and bool(((got - expected).abs() <= tolerance).all())


def test_semi_sync_plan_matches_a_loop_with_one_step_stale_embeddings_bitwise(ranks):
    """torchrec's TrainPipelineSemiSync fails on the CPU (tests/cuda/test_cuda_family.py compares
    with it on a GPU); the reference here is a plain loop in which batch i's lookup reads the
    tables from before batch i-1's update (recsys_pipe.testing.run_stale_embedding_reference).
    The staleness is real: from the second step on the losses differ from the serial plan's."""
    for data in ranks:
        variants = data["variants"]
        ref = variants["stale/reference"]
        for name in ("stale/semi_sync", "stale/semi_sync/threaded"):
            assert variants[name]["losses"] == ref["losses"], f"{name}: losses"
            assert variants[name]["sample_ids"] == ref["sample_ids"] == data["loader_ids"], f"{name}: batches"
            assert variants[name]["params"] == ref["params"], f"{name}: final parameters"
        serial = variants["serial"]["losses"]
        assert ref["losses"][0] == serial[0]  # batch 0 reads the initial tables in both
        assert all(a != b for a, b in zip(ref["losses"][1:], serial[1:]))  # batch 1 on: stale tables


def test_semi_sync_with_stashed_gradients_matches_its_reference_loop_bitwise(ranks):
    """semi_sync_stash (torchrec's stash_gradients=True): the dense step after batch i applies
    batch i-1's gradients; against the reference loop doing the same swap. It differs from
    semi_sync (the dense update is stale too)."""
    for data in ranks:
        variants = data["variants"]
        plan, ref = variants["stash/semi_sync_stash"], variants["stash/reference"]
        assert plan["losses"] == ref["losses"] and plan["params"] == ref["params"]
        assert plan["sample_ids"] == data["loader_ids"]
        stale = variants["stale/reference"]["losses"]
        assert plan["losses"][0] == stale[0]  # same initial weights
        assert all(a != b for a, b in zip(plan["losses"][1:], stale[1:]))  # no dense step after batch 0


def test_semi_sync_warm_up_matches_its_reference_loop_bitwise(ranks):
    """torchrec's start_batch as the plan's option (start_batch=5): batches 0..5 are looked up
    after the previous update (fresh), later ones one step stale; with stashed gradients the
    swap starts at batch 5. Against the reference loop with the same rule, bitwise; the warm-up
    is real: batches 1..5 equal the synchronous run, batch 6 on differ from it, and the whole run
    differs from the warm-up-less semi_sync."""
    for data in ranks:
        variants = data["variants"]
        serial, stale = variants["serial"]["losses"], variants["stale/reference"]["losses"]
        for plan, ref in (
            ("warm/semi_sync", "warm/reference"),
            ("warm/semi_sync/threaded", "warm/reference"),
            ("warmstash/semi_sync_stash", "warmstash/reference"),
        ):
            assert variants[plan]["losses"] == variants[ref]["losses"], f"{plan}: losses"
            assert variants[plan]["params"] == variants[ref]["params"], f"{plan}: final parameters"
            assert variants[plan]["sample_ids"] == data["loader_ids"], f"{plan}: batches"
        warm = variants["warm/reference"]["losses"]
        assert warm[:6] == serial[:6]  # synchronous up to start_batch
        assert all(a != b for a, b in zip(warm[6:], serial[6:]))  # then stale
        assert warm[6:] != stale[6:]
        assert variants["warmstash/reference"]["losses"][6:] != warm[6:]  # the stash changes the dense step


def test_grad_accumulation_on_semi_sync_matches_torchrecs_wrapper_bitwise(ranks):
    """trainer.grad_accumulation (4 micro-steps, 2 warmup) on the semi_sync plan against torchrec's
    GradientAccumulationWrapper around the stale-embedding reference loop (torchrec's SemiSync
    class cannot run on the CPU): same losses, batches and final parameters, bitwise."""
    for data in ranks:
        variants = data["variants"]
        ref = variants["ga4stale/reference"]
        for plan in ("ga4stale/semi_sync", "ga4stale/semi_sync/threaded"):
            assert variants[plan]["losses"] == ref["losses"], f"{plan}: losses"
            assert variants[plan]["params"] == ref["params"], f"{plan}: final parameters"
            assert variants[plan]["sample_ids"] == data["loader_ids"], f"{plan}: batches"
        assert ref["losses"] != variants["stale/reference"]["losses"]  # it really accumulates
        assert ref["losses"][0] == variants["stale/reference"]["losses"][0]
