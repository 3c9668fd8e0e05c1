"""recsys-train as a user runs it: the README main job, single-process runs, config errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(args, tmp_path, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}:{os.environ['PATH']}"}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)


def metrics(run_root):
    (path,) = Path(run_root).glob("recsys-train/*/metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_readme_main_job_trains_with_prefetch_plan_on_two_ranks(tmp_path):
    proc = run(["bash", str(ROOT / "scripts" / "train.sh"), f"trainer.output_dir={tmp_path}/runs"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "plan hstu_prefetch | 2 rank(s)" in proc.stderr
    records = metrics(tmp_path / "runs")
    evals = [r for r in records if "auc" in r]
    losses = [r["loss"] for r in records if "loss" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 200
    assert evals[-1]["auc"] > evals[0]["auc"] + 0.1
    assert sum(losses[-5:]) < sum(losses[:5])
    run_dirs = list((tmp_path / "runs" / "recsys-train").iterdir())
    assert len(run_dirs) == 1  # one directory for both ranks
    assert {p.name for p in run_dirs[0].iterdir()} == {"config.yaml", "train.log", "metrics.jsonl"}


@pytest.mark.timeout(200)
def test_single_process_run_writes_run_dir(tmp_path):
    proc = run(
        [str(BIN / "recsys-train"), "pipeline=serial", "trainer=smoke", f"trainer.output_dir={tmp_path}/r"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = metrics(tmp_path / "r")
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 9))
    assert [r["step"] for r in records if "auc" in r] == [0, 4, 8]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "override, path",
    [
        ("pipeline.tasks.forward.depends_on=[fwd]", "pipeline.tasks.forward.depends_on[0]"),
        ("pipeline.tasks.h2d.fn=recsys_pipe.train.tasks.nope", "pipeline.tasks.h2d.fn"),
        ("trainer.max_steps=0", "trainer.max_steps"),
    ],
)
def test_config_errors_exit_2_before_any_process_group(tmp_path, override, path):
    proc = run([str(BIN / "recsys-train"), override, f"trainer.output_dir={tmp_path}/r"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"error: {path}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


@pytest.mark.timeout(60)
def test_help_lists_groups():
    proc = subprocess.run([str(BIN / "recsys-train"), "--help"], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0
    for group in (
        "pipeline: hstu_prefetch, hstu_prefetch_balanced, hstu_sparse_dist, hstu_sparse_dist_balanced",
        "thread_map:",
        "trainer:",
    ):
        assert group in proc.stdout
