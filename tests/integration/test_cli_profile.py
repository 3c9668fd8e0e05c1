"""`recsys-profile` on the HSTU plan (2 ranks, CPU): the files it writes, the table it prints, and
that recsys-plan reads its costs; its config errors; and `trainer.torch_profiler.steps` (a torch
profiler trace of a step window, each task a record_function range on its own thread)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsys_pipe.autosched import CostModel
from recsys_pipe.cli.plan import run as plan_run
from recsys_pipe.cli.profile import run as profile_run
from recsys_pipe.engine import PlanRunner, RecordFunctionRanges, Task, TaskGraph, ThreadedExecutor
from recsys_pipe.testing import fork_ranks, load_run, worker_env
from recsys_pipe.train.torch_profile import StepWindow

BIN = Path(sys.executable).parent
#: hstu_prefetch's tasks in the order a CPU run runs them (its CPU layout: the input-dist wait
#: after forward, the prefetch after backward; recsys_pipe.train.plan.cpu_prefetch_layout)
HSTU_TASKS = [
    "h2d",
    "start_input_dist",
    "zero_grad",
    "forward",
    "wait_input_dist",
    "backward",
    "finalize_model_grads",
    "optimizer_step",
    "prefetch_embeddings",
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_profile_command_on_the_hstu_plan_with_two_ranks_writes_every_file(tmp_path, capsys):
    args = [
        "pipeline=hstu_prefetch",
        "trainer.device=cpu",
        "trainer.backend=gloo",
        "profile.warmup=2",
        "profile.iters=6",
        "profile.rounds=1",
        "data.num_batches=16",
        f"trainer.output_dir={tmp_path}/runs",
    ]
    proc = fork_ranks(BIN / "recsys-profile", *args, timeout=280, cwd=tmp_path)  # 2 ranks
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "recsys-profile").iterdir()
    assert {p.name for p in run_dir.iterdir()} == {
        "config.yaml",
        "status.json",  # started as recsys-train starts: its session records how it ended
        "train.log",
        "costs.json",
        "exposed.json",
        "trace.json",
        "timeline.png",
    }
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "completed" and status["exit_code"] == 0 and status["world_size"] == 2
    costs = CostModel.from_json(run_dir / "costs.json")
    assert list(costs.tasks) == HSTU_TASKS
    assert costs["h2d"].thread == "io" and costs["forward"].thread == "compute" and costs["h2d"].lookahead == 2
    assert all(c.samples == 6 and c.cpu_s > 0 and c.device_s == 0 for c in costs.tasks.values())
    assert costs.meta["plan"] == "hstu_prefetch" and costs.meta["world_size"] == 2
    assert costs.meta["iteration_s"] > costs["forward"].cpu_s
    # the batch pull and ring rotation are measured and written for the simulator
    assert 0 < costs.outside_tasks_s < costs.meta["iteration_s"] and costs.outside_tasks_mean_s > 0
    assert all(c.cpu_mean_s > 0 for c in costs.tasks.values())

    exposed = json.loads((run_dir / "exposed.json").read_text())
    assert set(exposed["exposed_s"]) == {"h2d"}  # the only task the HSTU plan can replay
    assert set(exposed["not_measured"]) == set(HSTU_TASKS) - {"h2d"}
    assert "one-shot awaitables" in exposed["not_measured"]["start_input_dist"]

    trace = json.loads((run_dir / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == {"thread:io", "thread:compute"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in spans} == set(HSTU_TASKS) and len(spans) == 6 * len(HSTU_TASKS)
    assert all("batch" in e["args"] and "iteration" in e["args"] for e in spans)
    assert (run_dir / "timeline.png").read_bytes()[:4] == b"\x89PNG"

    out = proc.stdout
    assert "task " in out and "exposed ms" in out and "simulated from the median costs" in out
    assert "simulated from the mean costs" in out
    assert "n/a: task 'forward' cannot be shortcut" in out

    # the profile loop: recsys-plan reads the measured costs and simulates the plan
    assert plan_run(["pipeline=hstu_prefetch", f"costs={run_dir / 'costs.json'}", f"hydra.run.dir={tmp_path}"]) == 0
    assert "predicted step:" in capsys.readouterr().out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "override, path",
    [
        ("profile.tasks=[forwrd]", "profile.tasks[0]: unknown task 'forwrd' (did you mean 'forward'?)"),
        ("data.num_batches=10", "data.num_batches: 10 batches per rank; each profiling pass needs 23"),
        ("profile.iters=1", "profile.iters"),
    ],
)
def test_config_errors_exit_2_before_anything_starts(tmp_path, capsys, override, path):
    assert profile_run([override, f"trainer.output_dir={tmp_path}/runs"]) == 2
    assert f"error: {path}" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_torch_profiler_steps_are_validated():
    assert load_run("trainer.torch_profiler.steps=[2,3]").trainer.torch_profiler.steps == [2, 3]
    for bad in ("[3,2]", "[0,1]", "[1,2,3]"):
        from recsys_pipe.config import ConfigError

        with pytest.raises(ConfigError, match="trainer.torch_profiler.steps"):
            load_run(f"trainer.torch_profiler.steps={bad}")


@pytest.mark.timeout(60)
def test_step_window_traces_only_its_steps_with_a_range_per_task_on_each_thread(tmp_path):
    def work(ctx):
        torch.ones(64).sum()

    tasks = [Task.from_fn("load", work, lookahead=1, writes=["x"]), Task.from_fn("train", work, reads=["x"])]
    with PlanRunner(TaskGraph.single_group(tasks), executor=ThreadedExecutor({"load": "io"})) as runner:
        window = StepWindow([2, 3], str(tmp_path), rank=1, runner=runner)
        window.step(0)
        for step, _ in enumerate(runner.iterate(range(6)), start=1):
            assert window.active == (step in (2, 3))  # recording while steps 2 and 3 ran
            window.step(step)
            assert isinstance(runner.observer, RecordFunctionRanges) == (step in (1, 2))
        window.close()
    trace = json.loads((tmp_path / "torch_trace" / "rank1.json").read_text())
    events = trace["traceEvents"]
    steps = sorted(e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
    ranges = [e for e in events if e.get("name") in ("load", "train") and e.get("ph") == "X"]
    assert sorted(e["name"] for e in ranges) == ["load", "load", "train", "train"]
    assert (
        len({e["tid"] for e in ranges if e["name"] == "load"} | {e["tid"] for e in ranges if e["name"] == "train"}) == 2
    )
    ops = (tmp_path / "torch_trace" / "rank1_ops.txt").read_text()
    assert "Self CPU" in ops.splitlines()[1]  # torch's table header
    assert "aten::sum" in ops  # the tasks' work, counted in the window


@pytest.mark.timeout(120)
def test_recsys_train_writes_the_torch_trace_of_the_configured_steps(tmp_path):
    env = worker_env()
    proc = subprocess.run(
        [
            str(BIN / "recsys-train"),
            "pipeline=hstu_prefetch",
            "trainer=smoke",
            "trainer.eval_every=0",
            "trainer.max_steps=4",
            "trainer.torch_profiler.steps=[2,3]",
            f"trainer.output_dir={tmp_path}/r",
        ],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = (tmp_path / "r").glob("recsys-train/*/torch_trace/rank0.json")
    events = json.loads(path.read_text())["traceEvents"]
    tids = {}
    for e in events:
        if e.get("name") in HSTU_TASKS and e.get("ph") == "X":
            tids.setdefault(e["name"], set()).add(e["tid"])
    assert set(tids) == set(HSTU_TASKS)
    assert tids["h2d"] != tids["forward"]  # the io thread's tasks are traced too


@pytest.mark.timeout(120)
def test_a_stop_request_ends_the_profile_before_its_next_pass():
    """SIGTERM under recsys-profile (it starts as recsys-train does, its handler installed): the
    ranks agree before each profiling pass, and once asked, none starts another."""
    from _process_group import one_rank_group

    from recsys_pipe.cli.profile import ProfileConfig, _measure, _Preempted
    from recsys_pipe.runtime.preemption import StopRequest
    from recsys_pipe.train import Trainer, build_parts, training_plan

    with one_rank_group() as info:
        run = load_run("pipeline=serial", "trainer=smoke", "trainer.device=cpu", "data.num_batches=12")
        stop = StopRequest()
        trainer = Trainer(build_parts(run, training_plan(run), info), stop=stop)
        try:
            stop.requested.set()  # what the SIGTERM handler does
            with pytest.raises(_Preempted):
                _measure(trainer, ProfileConfig(warmup=1, iters=3, rounds=1, exposed=False))
        finally:
            trainer.close()
