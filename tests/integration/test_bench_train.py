"""`python -m recsys_pipe.bench.train --quick` runs end to end on 2 gloo ranks and prints its final
JSON line; its speed gate fails a run where a plan is slower than its torchrec class in a clean
window, and only warns where the window was not clean.

Figures of the real run are not asserted (timings belong to benchmark runs); the benchmark itself
asserts that every variant trained bitwise-equal per-step losses, and the report says that check
ran. The gate is checked on fabricated measurement records, whose figures are known.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recsys_pipe.bench.train import aggregate, enforce_speed_gate, parse_args, speed_gate

ROOT = Path(__file__).resolve().parents[2]
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
    proc = subprocess.run(  # started as a plain module: it re-executes itself under torchrun
        [sys.executable, "-m", "recsys_pipe.bench.train", "--quick", "--variants", ",".join(variants)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
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
    assert "speed gate: off" in proc.stdout and report["speed_gate"]["min_ratio"] == 0.0  # --quick


# -- the speed gate, on fabricated records ---------------------------------------------------------

CORES, STEPS, BATCH = 2, 10, 32


def rank_record(seconds: float, other_load: float) -> dict:
    """One rank's figures of one run: half a core busy per rank (the two ranks: 0.5 of the
    machine), and the machine busier by `other_load` (other jobs)."""
    cpu_seconds = 0.5 * seconds
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "machine_busy": 2 * cpu_seconds / (CORES * seconds) + other_load,
        "gc_seconds": [0.0, 0.0, 0.0],
        "gc_count": [0, 0, 0],
        "peak_rss_mib": None,
    }


def fabricated_report(plan_seconds: float, class_seconds: float, other_load: float = 0.0) -> dict:
    """The report of 3 repetitions of sparse_dist and torchrec_sdd (its class) on 2 ranks."""
    records = {
        name: [[rank_record(seconds, other_load) for _ in range(2)] for _ in range(3)]
        for name, seconds in (("sparse_dist", plan_seconds), ("torchrec_sdd", class_seconds))
    }
    rows = aggregate(records, BATCH, STEPS, 2, CORES)
    return {"batches": {str(BATCH): {"variants": rows}}}


def test_speed_gate_fails_a_slow_plan_in_a_clean_window(capsys):
    report = fabricated_report(plan_seconds=1.0, class_seconds=0.9)  # 0.9x of torchrec_sdd
    assert report["batches"]["32"]["variants"]["sparse_dist"]["vs_counterpart"]["median"] == 0.9
    gate = speed_gate(report, 0.95, 0.10)
    assert gate["failed"] == [
        {"batch_size": 32, "plan": "sparse_dist", "class": "torchrec_sdd", "ratio": 0.9, "other_load": 0.0}
    ]
    assert gate["passed"] == gate["not_clean"] == []
    with pytest.raises(SystemExit) as exit_info:
        enforce_speed_gate(gate)
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == (
        "bench_train: plan sparse_dist at 0.900x of torchrec_sdd (batch 32), below the gate's 0.95x in a clean window\n"
    )


def test_speed_gate_only_warns_when_the_window_was_not_clean(capsys):
    report = fabricated_report(plan_seconds=1.0, class_seconds=0.9, other_load=0.3)
    gate = speed_gate(report, 0.95, 0.10)
    assert gate["failed"] == gate["passed"] == []
    assert [(v["plan"], v["ratio"], v["other_load"]) for v in gate["not_clean"]] == [("sparse_dist", 0.9, 0.3)]
    enforce_speed_gate(gate)  # no exit
    err = capsys.readouterr().err
    assert err.startswith("bench_train: warning: not judged, the window was not clean: batch 32 sparse_dist: 0.900x")
    assert "other jobs at most 30%" in err


def test_speed_gate_passes_a_plan_at_the_limit_and_can_be_off():
    at_limit = speed_gate(fabricated_report(plan_seconds=1.0, class_seconds=0.95), 0.95, 0.10)
    assert [v["plan"] for v in at_limit["passed"]] == ["sparse_dist"] and not at_limit["failed"]
    enforce_speed_gate(at_limit)
    off = speed_gate(fabricated_report(plan_seconds=1.0, class_seconds=0.5), 0.0, 0.10)
    assert off["passed"] == off["failed"] == off["not_clean"] == []


def test_quick_turns_the_gate_off_and_the_default_is_095(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train", "--quick"])
    assert parse_args().min_vs_class == 0.0
    monkeypatch.setattr(sys, "argv", ["train"])
    assert parse_args().min_vs_class == 0.95
    monkeypatch.setattr(sys, "argv", ["train", "--quick", "--min-vs-class", "0.9"])
    assert parse_args().min_vs_class == 0.9


def test_a_failed_gate_ends_the_benchmark_process_with_exit_1():
    """Through the benchmarks' shared teardown (`run_ranks`), as the benchmark ends: exit status 1."""
    gate = speed_gate(fabricated_report(plan_seconds=1.0, class_seconds=0.9), 0.95, 0.10)
    code = (
        "import json, sys\n"
        "from recsys_pipe.bench.common import run_ranks\n"
        "from recsys_pipe.bench.train import enforce_speed_gate\n"
        "run_ranks(lambda: enforce_speed_gate(json.loads(sys.argv[1])))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(gate)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 1
    assert "plan sparse_dist at 0.900x of torchrec_sdd" in out.stderr
