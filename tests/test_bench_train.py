"""scripts/bench_train.py --quick runs end to end on 2 gloo ranks and prints its final JSON line.

Figures are not asserted (timings belong to benchmark runs); the script itself asserts that
every variant trained bitwise-equal per-step losses, and the report says that check ran.
"""

import json
from pathlib import Path

import pytest

from recsys_pipe.testing import check_torchrun, run_torchrun

ROOT = Path(__file__).resolve().parents[1]
PLANS = {
    "serial",
    "sparse_dist",
    "hstu_sparse_dist/sequential",
    "hstu_sparse_dist/threaded",
    "hstu_prefetch/sequential",
    "hstu_prefetch/threaded",
}
#: torchrec's pipeline family: plan files and the torchrec classes that run on the CPU
FAMILY_PLANS = {"base", "sparse_dist_lite", "sparse_dist_enqueue_after_forward", "prefetch", "fused_sparse_dist"}
FAMILY_CLASSES = {"torchrec_sdd", "torchrec_base", "torchrec_lite", "torchrec_sdd_enqueue_after_forward"}
COUNTERPARTS = {
    "sparse_dist": "torchrec_sdd",
    "base": "torchrec_base",
    "sparse_dist_lite": "torchrec_lite",
    "sparse_dist_enqueue_after_forward": "torchrec_sdd_enqueue_after_forward",
}


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_bench_train_quick_reports_every_variant_and_checks_losses():
    """Every shipped plan, the family's plan files and torchrec's classes (those that run on the
    CPU), with the semi_sync plan checked on its own (stale embeddings: other losses)."""
    variants = sorted(PLANS | FAMILY_PLANS | FAMILY_CLASSES | {"semi_sync"})
    proc = run_torchrun(
        ROOT / "scripts" / "bench_train.py",
        "--quick",
        "--variants",
        ",".join(variants),
        timeout=280,
        env={"PYTHONPATH": str(ROOT)},
    )
    check_torchrun(proc)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"machine", "repeats", "batches", "targets", "observer_us_per_step"} <= set(report)
    assert report["machine"]["ranks"] == 2 and report["machine"]["pinned"] is True
    (entry,) = report["batches"].values()
    rows = entry["variants"]
    assert set(rows) == set(variants)
    assert entry["losses"] == {
        "checked": True,
        "equal": True,
        "runs": len(rows),
        "steps": entry["warmup"] + entry["steps"] + 2,
        "note": entry["losses"]["note"],
    }
    for name, row in rows.items():
        assert row["samples_per_s"]["median"] > 0 and row["cpu_ms_per_step"]["median"] > 0, name
        assert row["vs_torchrec"]["median"] > 0 and row["peak_rss_mib"]["median"] > 0, name
        if name in PLANS:  # engine figures come from the engine's observer
            assert row["engine_us_per_step"]["median"] >= 0 and row["release_us_per_step"]["median"] > 0, name
            assert set(row["rank0_task_ms_per_step"]) >= {"forward", "backward", "optimizer_step"}, name
    assert rows["torchrec_sdd"]["vs_torchrec"]["median"] == 1.0
    assert "engine_us_per_step" not in rows["torchrec_sdd"]
    for plan, torchrec_class in COUNTERPARTS.items():  # the paired ratio to the plan's own class
        assert rows[plan]["vs_counterpart"]["variant"] == torchrec_class and rows[plan]["vs_counterpart"]["median"] > 0
    assert "stale embeddings (semi_sync)" in entry["losses"]["note"]
    assert set(report["targets"]["met"]["16"]) == (PLANS | FAMILY_PLANS | {"semi_sync"}) - {"serial"}
    assert "targets:" in proc.stdout
