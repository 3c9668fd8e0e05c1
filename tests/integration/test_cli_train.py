"""recsys-train as a user runs it: the README main job, single-process runs, config errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recsys_pipe.testing import fork_ranks, worker_env

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(args, tmp_path, timeout=300):
    env = worker_env(PATH=f"{BIN}:{os.environ['PATH']}")
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)


def one_rank(args, tmp_path, timeout=300):
    """`run` on a rank forked from a process that has imported the stack once (`fork_ranks`):
    for the tests whose subject is what the run does, not how a plain process starts."""
    return fork_ranks(args[0], *args[1:], nproc=1, timeout=timeout, cwd=tmp_path)


def metrics(run_root):
    (path,) = Path(run_root).glob("recsys-train/*/metrics.jsonl")  # exactly one run
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
    names = {p.name for p in run_dirs[0].iterdir()}
    assert {"config.yaml", "train.log", "metrics.jsonl"} <= names
    assert any(name.startswith("events.out.tfevents") for name in names)  # TensorBoard, rank 0 only


@pytest.mark.timeout(300)
def test_single_process_run_writes_run_dir_and_tensorboard(tmp_path):
    """Then two resumes (from step 3 of the first run, then from the latest, step 10 of the
    second) go on in the first run's TensorBoard run: TensorBoard reads steps 1..12, each once
    (the first run's steps 4..8, trained again by the second, are dropped at its restart)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = [str(BIN / "recsys-train"), "pipeline=serial", "trainer=smoke", f"trainer.output_dir={tmp_path}/r"]
    proc = run([*train, "trainer.checkpoint.interval=3"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = metrics(tmp_path / "r")
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 9))
    assert [r["step"] for r in records if "auc" in r] == [0, 4, 8]
    assert "step 8 | epoch 1 | loss " in proc.stderr and " samples/s | lr 0.001 | mem " in proc.stderr
    (run_dir,) = (tmp_path / "r" / "recsys-train").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/samples_per_s", "train/lr", "eval/auc", "eval/loss"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in records if "loss" in r])

    for resume in (f"trainer.resume_from={run_dir}/checkpoints/step_3", "trainer.resume_from=latest"):
        steps = "trainer.max_steps=10" if "step_3" in resume else "trainer.max_steps=12"
        again = run([*train, "trainer.checkpoint.interval=3", resume, steps], tmp_path)
        assert again.returncode == 0, again.stderr[-4000:]
    resumed = sorted(d for d in (tmp_path / "r" / "recsys-train").iterdir() if d != run_dir)
    assert len(resumed) == 2
    for directory in resumed:  # their events went to the first run's directory
        assert (directory / "tensorboard_dir").read_text().strip() == str(run_dir)
        assert not any(name.name.startswith("events.out.tfevents") for name in directory.iterdir())
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 13))
    resumed_losses = [json.loads(line) for d in resumed for line in (d / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["loss"] for r in resumed_losses if "loss" in r}
    assert [e.value for e in events.Scalars("train/loss")][3:] == pytest.approx([by_step[s] for s in range(4, 13)])


@pytest.mark.timeout(200)
def test_epochs_reshuffle_evaluate_at_epoch_ends_and_say_why_training_stopped(tmp_path):
    proc = one_rank(
        [
            str(BIN / "recsys-train"),
            "pipeline=hstu_prefetch",
            "trainer=smoke",
            "trainer.epochs=5",
            "trainer.eval_epochs=2",
            "data.num_batches=4",
            "data.shuffle=true",
            "trainer.max_steps=30",
            "trainer.eval_every=100",
            "trainer.precision=bf16",
            f"trainer.output_dir={tmp_path}/r",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    err = proc.stderr
    assert "trainer.max_steps=30 exceeds trainer.epochs=5 x 4 batches per epoch: training stops after step 20" in err
    for epoch in (1, 2, 3, 4, 5):
        assert f"epoch {epoch}/5 done at step {4 * epoch}" in err
    assert "training stopped at step 20: epochs done (5 epoch(s) of 4 batches)" in err
    assert "the data ran out at step 20, before trainer.max_steps=30" in err
    records = metrics(tmp_path / "r")
    # before step 1, at the end of every 2nd epoch, and after the last step
    assert [r["step"] for r in records if "auc" in r] == [0, 8, 16, 20]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 20 and all(0 < loss < 10 for loss in losses)  # bf16 autocast trains


@pytest.mark.timeout(200)
def test_sigterm_checkpoints_exits_75_and_latest_resumes(tmp_path):
    """A real SIGTERM to a single-process run (as a scheduler sends it), then a requeued run with
    resume_from=latest continues from the step it stopped after."""
    args = [
        str(BIN / "recsys-train"),
        "pipeline=hstu_sparse_dist",
        "trainer=smoke",
        "trainer.max_steps=null",
        "data.num_batches=5000",
        "trainer.eval_every=0",
        f"trainer.output_dir={tmp_path}/r",
    ]
    env = worker_env(PATH=f"{BIN}:{os.environ['PATH']}")
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list((tmp_path / "r").glob("recsys-train/*/metrics.jsonl")):
            time.sleep(0.05)
        while time.monotonic() < deadline and len(metrics(tmp_path / "r")) < 3:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err[-3000:]
    stopped = max(r["step"] for r in metrics(tmp_path / "r") if "loss" in r)
    assert f"SIGTERM received: stopped after step {stopped} on every rank" in err
    assert f"checkpoint step {stopped} -> " in err
    again = one_rank([*args, "trainer.max_steps=" + str(stopped + 2), "trainer.resume_from=latest"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {tmp_path}/r/recsys-train/" in again.stderr and f"step {stopped}, epoch 1" in again.stderr
    newest = max((tmp_path / "r" / "recsys-train").iterdir(), key=lambda p: p.stat().st_mtime)
    resumed = [json.loads(line) for line in (newest / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed if "loss" in r] == [stopped + 1, stopped + 2]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "overrides, paths",
    [
        # two plan errors in one run: both are reported (one process start instead of two)
        (
            ["pipeline.tasks.forward.depends_on=[fwd]", "pipeline.tasks.h2d.fn=recsys_pipe.train.tasks:nope"],
            ["pipeline.tasks.forward.depends_on[0]", "pipeline.tasks.h2d.fn"],
        ),
        (["trainer.max_steps=0"], ["trainer.max_steps"]),
    ],
)
def test_config_errors_exit_2_before_any_process_group(tmp_path, overrides, paths):
    proc = run([str(BIN / "recsys-train"), *overrides, f"trainer.output_dir={tmp_path}/r"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    for path in paths:
        assert f"error: {path}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


@pytest.mark.timeout(60)
def test_help_lists_groups(capsys):
    # in this process (the console script's --help runs in test_failures.py, through scripts/train.sh)
    from recsys_pipe.cli import train as train_cli

    assert train_cli.run(["--help"]) == 0
    out = capsys.readouterr().out
    for group in (
        "pipeline: base, dlrm_prefetch, fused_sparse_dist, hstu_prefetch, hstu_prefetch_balanced, hstu_sparse_dist",
        "thread_map:",
        "trainer:",
    ):
        assert group in out


@pytest.mark.timeout(300)
def test_resume_says_what_it_changes_and_when_there_is_nothing_to_train(tmp_path):
    """Resuming an adam / 4-micro-step / hstu_prefetch checkpoint with sgd, 2 micro-steps and the
    serial plan says so in one line each; at its max_steps already, it says why nothing trains
    (not `loss nan -> nan`) and exits 0. sgd -> adam is refused with exit 2: the checkpoint has
    no Adam state."""
    common = [str(BIN / "recsys-train"), "trainer=smoke", "trainer.checkpoint.interval=4", "trainer.tensorboard=false"]
    first = one_rank([*common, "trainer.grad_accumulation.steps=4", f"trainer.output_dir={tmp_path}/a"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    changed = [
        *common,
        "optimizer=sgd",
        "trainer.grad_accumulation.steps=2",
        "pipeline=serial",
        f"trainer.output_dir={tmp_path}/a",
        "trainer.resume_from=latest",
    ]
    again = one_rank(changed, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    lines = [line for line in again.stderr.splitlines() if "[WARNING] resuming with" in line]
    assert len(lines) == 3, again.stderr[-3000:]
    assert "optimizer.name=sgd, the checkpoint's run used adam: its dense optimizer state is dropped" in lines[0]
    assert "trainer.grad_accumulation.steps=2, the checkpoint's run used 4" in lines[1]
    assert "pipeline=serial, the checkpoint's run used hstu_prefetch" in lines[2]
    assert "nothing to train: step 8 >= trainer.max_steps=8" in again.stderr
    assert "trained nothing: at step 8, max_steps reached" in again.stderr and "nan" not in again.stderr
    sgd = one_rank([*common, "optimizer=sgd", "optimizer.momentum=0.9", f"trainer.output_dir={tmp_path}/b"], tmp_path)
    assert sgd.returncode == 0, sgd.stderr[-3000:]
    refused = one_rank(
        [*common, "trainer.max_steps=12", f"trainer.output_dir={tmp_path}/b", "trainer.resume_from=latest"], tmp_path
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "error: trainer.resume_from:" in refused.stderr
