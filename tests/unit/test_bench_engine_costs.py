"""`recsys-bench engine_costs`: the engine's per-task device costs, each alone."""

from __future__ import annotations

import json


def test_engine_costs_quick_splits_the_per_task_cost(capsys) -> None:
    """`recsys-bench engine_costs --quick` on the CPU's no-op streams: every part timed."""
    from recsys_pipe.bench.engine_costs import main as engine_costs

    engine_costs(["--quick"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["streams"] == "no-op streams"
    parts = report["us_per_call"]
    for name in ("stream_entry", "event_record", "event_wait", "stream_wait", "latch_hand_off", "queue_hand_off"):
        assert parts[name]["median"] > 0, name
    assert parts["latch_hand_off"]["median"] > parts["event_record"]["median"]  # a thread switch is the dear part


def test_engine_costs_counts_the_stream_work_of_a_task() -> None:
    """The plan section's counts on the CPU's counting streams: the prefetch layout waits 4 times
    per iteration (3 of its 7 waits are implied in the steady state), records its 4 events into
    objects it already has, and switches streams 5 times (9 tasks on one thread)."""
    from recsys_pipe.bench.engine_costs import plan_counts, prefetch_layout

    counts = plan_counts(prefetch_layout(), iterations=20)
    assert counts == {
        "waits": round(4 / 9, 3),
        "records": round(4 / 9, 3),
        "new_events": 0.0,
        "stream_entries": round(5 / 9, 3),
    }


def test_the_prefetch_layout_is_the_shipped_prefetch_plan() -> None:
    """`prefetch_layout` declares what conf/pipeline/prefetch.yaml composes to (for the GPU
    machine, which cannot compose plans without the training stack)."""
    from recsys_pipe.bench.engine_costs import prefetch_layout
    from recsys_pipe.testing import load_run
    from recsys_pipe.train import training_plan

    fields = (
        "lookahead",
        "stream",
        "reads",
        "writes",
        "depends_on",
        "cross_iter_depends_on",
        "same_progress_sync",
        "nccl",
    )
    shipped = training_plan(load_run("pipeline=prefetch", "trainer.device=cuda"), resolve_fn=lambda path: print)

    def declared(graph):
        return {t.name: tuple(str(getattr(t, f)) for f in fields) for t in graph.tasks}

    assert declared(prefetch_layout()) == declared(shipped.task_graph)
