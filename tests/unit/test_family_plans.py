"""torchrec's pipeline family as plan files: each prints exactly its reference text, is drawn,
and restates only what differs from the plan it derives from.

The numbers (bitwise against torchrec's own classes on 2 gloo ranks) are checked by
tests/integration/test_train_parity.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recsys_pipe.testing import recsys_plan

GOLDEN = Path(__file__).resolve().parents[1] / "golden"

#: plan -> the plan it derives from
FAMILY = {
    "base": "serial",
    "sparse_dist_lite": "base",
    "sparse_dist_enqueue_after_forward": "sparse_dist",
    "prefetch": "sparse_dist",
    "fused_sparse_dist": "sparse_dist",
    "semi_sync": "serial",
    "semi_sync_stash": "semi_sync",
}


@pytest.mark.parametrize("pipeline", sorted(FAMILY))
@pytest.mark.parametrize("thread_map", ["hstu_default", "by_stream", "per_task"])
def test_family_plans_print_exactly_their_reference_text(tmp_path, capsys, pipeline, thread_map):
    assert recsys_plan(tmp_path, f"pipeline={pipeline}", f"thread_map={thread_map}", "trainer.device=cuda") == 0
    expected = (GOLDEN / f"plan_{pipeline}.{thread_map}.txt").read_text()  # as declared: planned for a GPU
    assert (tmp_path / "plan.txt").read_text() == expected


@pytest.mark.parametrize("pipeline", sorted(FAMILY))
def test_family_plans_are_drawn(tmp_path, capsys, pipeline):
    assert recsys_plan(tmp_path, f"pipeline={pipeline}", "plot=true") == 0
    for name in ("plan_timing.png", "plan_dag.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_family_plans_restate_only_what_differs():
    from recsys_pipe.config import CONF_DIR

    texts = {p.stem: p.read_text() for p in (CONF_DIR / "pipeline").glob("*.yaml")}
    for name, parent in FAMILY.items():
        assert f"defaults:\n  - {parent}\n  - _self_\n" in texts[name], name
        assert "#   part" in texts[name], f"{name}: no part/stream table in its header"
    assert texts["prefetch"].count("fn: ") == 1  # prefetch_embeddings, the one task sparse_dist lacks
    assert texts["fused_sparse_dist"].count("fn: ") == 1  # start_embedding_lookup
    assert texts["semi_sync"].count("fn: ") == 3  # the stale and the synced lookup, embedding_backward
    assert texts["semi_sync_stash"].count("fn: ") == 1  # stash_gradients
    for name in ("base", "sparse_dist_lite", "sparse_dist_enqueue_after_forward"):
        assert texts[name].count("fn: ") == 0, name


def test_schedules_follow_torchrecs_order(tmp_path, capsys):
    """The order each iteration submits the tasks in is torchrec's order within `progress()`."""

    def order(pipeline: str) -> list[str]:
        assert recsys_plan(tmp_path / pipeline, f"pipeline={pipeline}") == 0
        text = (tmp_path / pipeline / "plan.txt").read_text().split("tasks, in topological order", 1)[1]
        rows = text.split("\n\n", 1)[0].splitlines()[3:]
        return [row.split()[1] for row in rows if row.strip() and row.split()[0].isdigit()]

    train = ["finalize_model_grads", "optimizer_step"]
    # TrainPipelineBase / Lite: zero_grad, (input dist), forward, backward, copy of i+1, optimizer
    for name in ("base", "sparse_dist_lite"):
        assert order(name) == ["zero_grad", "start_input_dist", "wait_input_dist", "forward", "backward", "h2d", *train]
    # enqueue_batch_after_forward: start dist (i+1), forward (i), copy (i+2), wait dist (i+1)
    assert order("sparse_dist_enqueue_after_forward") == [
        "start_input_dist",
        "zero_grad",
        "forward",
        "h2d",
        "wait_input_dist",
        "backward",
        *train,
    ]
    # TrainPipelineFusedSparseDist: the lookup of i+1 is submitted after step i (torchrec: at the top of step i+1)
    assert order("fused_sparse_dist") == [
        "h2d",
        "start_input_dist",
        "zero_grad",
        "forward",
        "wait_input_dist",
        "backward",
        *train,
        "start_embedding_lookup",
    ]
    # TrainPipelineSemiSync: start dist (i+2), forward (i), copy (i+3), lookup (i+1), wait dist (i+2),
    # backward (i), the embeddings' backward (i), optimizer, and during the warm-up (batches up to
    # start_batch) the lookup of i+1 after the optimizer instead
    assert order("semi_sync") == [
        "start_input_dist",
        "zero_grad",
        "forward",
        "h2d",
        "start_embedding_lookup",
        "wait_input_dist",
        "backward",
        "embedding_backward",
        *train,
        "start_embedding_lookup_synced",
    ]


def test_semi_sync_staleness_is_declared_in_the_plan():
    """The lookup of batch i+1 runs one batch ahead and before backward (i) in the same
    iteration: the plan's fields say the embeddings are one step stale."""
    from recsys_pipe.testing import load_run

    tasks = load_run("pipeline=semi_sync").pipeline.tasks
    assert tasks["start_embedding_lookup"].lookahead == tasks["backward"].lookahead + 1
    assert "start_embedding_lookup" in tasks["backward"].same_progress_sync
    # the warm-up's lookup (torchrec's start_batch): also one batch ahead, but after the update
    synced = tasks["start_embedding_lookup_synced"]
    assert synced.lookahead == 1 and synced.same_progress_sync == ["optimizer_step"]
    assert synced.options == {"start_batch": 0, "batches": "until"}
    assert tasks["start_embedding_lookup"].options == {"start_batch": 0, "batches": "after"}
    warm = load_run("pipeline=semi_sync_stash", "pipeline.tasks.start_embedding_lookup.options.start_batch=5")
    assert warm.pipeline.tasks["start_embedding_lookup_synced"].options["start_batch"] == 5  # one setting
    assert warm.pipeline.tasks["stash_gradients"].options == {"start_batch": 5}
    assert "start_embedding_lookup" in tasks["backward"].same_progress_sync
    fused = load_run("pipeline=fused_sparse_dist").pipeline.tasks  # after backward: not stale
    assert "backward" in fused["start_embedding_lookup"].same_progress_sync
