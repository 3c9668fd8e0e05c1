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
