"""`recsys-plan`: output, Hydra conventions, pictures, and the catalogue of refused configs.

Runs the CLI in-process through `recsys_pipe.cli.plan.run(argv) -> exit code` (fast); a few
subprocess runs prove the installed console script and its exit codes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recsys_pipe.cli.plan import run
from recsys_pipe.testing import recsys_plan

RECSYS_PLAN = shutil.which("recsys-plan") or str(Path(sys.executable).with_name("recsys-plan"))


# -- happy paths ----------------------------------------------------------------------------------


def test_prints_the_resolved_plan(tmp_path, capsys):
    assert recsys_plan(tmp_path, "pipeline=hstu_prefetch", *REFERENCE_LAYOUT) == 0
    out = capsys.readouterr().out
    for fragment in [
        "plan: hstu_prefetch",
        "executor: threaded",
        "in-flight batches: 3",
        "tasks, in topological order",
        "CPU dependency edges",
        "event waits",
        "same_progress_sync",
        "progress() returns",
    ]:
        assert fragment in out, fragment
    assert re.search(r"prefetch_embeddings +-> +backward +same_progress_sync", out)
    # the resolved config and the text are saved in the run dir
    assert (tmp_path / ".hydra" / "config.yaml").is_file()
    assert (tmp_path / "plan.txt").read_text().startswith("plan: hstu_prefetch")


GOLDEN = Path(__file__).resolve().parents[1] / "golden"
#: the reference texts are the plans as declared, torchrec's layout: as planned for a GPU (a CPU
#: run moves the prefetch plans' input-dist wait and prefetch: test_cpu_prefetch_layout below)
REFERENCE_LAYOUT = ("trainer.device=cuda",)


@pytest.mark.parametrize("pipeline", ["serial", "sparse_dist", "hstu_sparse_dist", "hstu_prefetch"])
@pytest.mark.parametrize("thread_map", ["hstu_default", "by_stream", "per_task"])
def test_shipped_plans_print_exactly_their_reference_text(tmp_path, capsys, pipeline, thread_map):
    """The plans are Hydra derivations of one task set (serial <- sparse_dist <- hstu_sparse_dist;
    sparse_dist <- prefetch <- hstu_prefetch); each must compile to exactly the task graph it
    printed as a stand-alone file."""
    assert recsys_plan(tmp_path, f"pipeline={pipeline}", f"thread_map={thread_map}", *REFERENCE_LAYOUT) == 0
    expected = (GOLDEN / f"plan_{pipeline}.{thread_map}.txt").read_text()
    assert (tmp_path / "plan.txt").read_text() == expected


@pytest.mark.parametrize("pipeline", ["serial_balanced", "hstu_sparse_dist_balanced", "hstu_prefetch_balanced"])
def test_balanced_plans_print_exactly_their_reference_text(tmp_path, capsys, pipeline):
    """With the default thread map (hstu_default: the shuffle tasks on io with h2d)."""
    assert recsys_plan(tmp_path, f"pipeline={pipeline}", *REFERENCE_LAYOUT) == 0
    assert (tmp_path / "plan.txt").read_text() == (GOLDEN / f"plan_{pipeline}.default.txt").read_text()


def test_derived_plans_restate_only_what_differs():
    from recsys_pipe.config import CONF_DIR

    texts = {p.stem: p.read_text() for p in (CONF_DIR / "pipeline").glob("*.yaml")}
    assert texts["serial"].count("fn: ") == 8  # the one full task set
    assert texts["sparse_dist"].count("fn: ") == 0 and "- serial" in texts["sparse_dist"]
    assert texts["hstu_sparse_dist"].count("fn: ") == 0 and "- sparse_dist" in texts["hstu_sparse_dist"]
    assert texts["hstu_prefetch"].count("fn: ") == 0 and "- prefetch" in texts["hstu_prefetch"]
    for balanced, parent in [
        ("serial_balanced", "serial"),
        ("hstu_sparse_dist_balanced", "hstu_sparse_dist"),
        ("hstu_prefetch_balanced", "hstu_prefetch"),
    ]:  # the two shuffle tasks on top of the parent
        assert texts[balanced].count("fn: ") == 2 and f"- {parent}\n" in texts[balanced]


def test_overrides_show_in_output_and_saved_config(tmp_path, capsys):
    assert recsys_plan(tmp_path, "thread_map=per_task", "pipeline.tasks.h2d.lookahead=3") == 0
    out = capsys.readouterr().out
    assert "in-flight batches: 4" in out
    assert "thread map: per_task" in out
    saved = (tmp_path / ".hydra" / "overrides.yaml").read_text()
    assert "pipeline.tasks.h2d.lookahead=3" in saved
    assert "lookahead: 3" in (tmp_path / ".hydra" / "config.yaml").read_text()


def test_plot_writes_pngs(tmp_path, capsys):
    assert recsys_plan(tmp_path, "pipeline=hstu_prefetch", "plot=true") == 0
    for name in ("plan_timing.png", "plan_dag.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    assert (tmp_path / "plan_dag.dot").read_text().startswith("digraph plan")
    assert "wrote" in capsys.readouterr().out


def test_help_lists_groups_and_options(capsys):
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    assert "recsys-plan: compile a training plan" in out
    assert (
        "pipeline: base, dlrm_prefetch, fused_sparse_dist, hstu_prefetch, hstu_prefetch_balanced, hstu_sparse_dist, "
        "hstu_sparse_dist_balanced, prefetch, retrieval_prefetch, semi_sync, semi_sync_stash, serial, serial_balanced, "
        "sparse_dist, sparse_dist_enqueue_after_forward, sparse_dist_lite" in out
    )
    assert "model: custom, dlrm, dlrm_dcn, dlrm_torch, hstu_retrieval, hstu_retrieval_large, hstu_small, sasrec" in out
    assert "data: criteo, criteo_synthetic, custom, movielens, parquet, parquet_sequences, sequences, synthetic" in out
    assert "thread_map: by_stream, hstu_default, per_task, plan, single" in out
    for group in ("model:", "data:", "optimizer:", "trainer:"):
        assert group in out


def test_cfg_job_prints_composed_config(capsys):
    assert run(["--cfg", "job", "pipeline=serial", "thread_map=single"]) == 0
    out = capsys.readouterr().out
    assert "name: serial" in out and "strategy: single" in out and "executor: sequential" in out


def test_multirun_sweeps_thread_maps(tmp_path, capsys):
    code = run(["-m", "thread_map=by_stream,per_task,hstu_default", f"hydra.sweep.dir={tmp_path}"])
    assert code == 0
    texts = [(tmp_path / str(i) / "plan.txt").read_text() for i in range(3)]
    assert "thread map: by_stream" in texts[0]
    assert "thread map: per_task" in texts[1]
    assert "thread map: hstu_default" in texts[2]


@pytest.mark.parametrize("multirun", [False, True])
def test_hydra_composes_the_config_once_besides_the_check(tmp_path, capsys, monkeypatch, multirun):
    """Our check composes each job, and Hydra then composes it to run; Hydra's own reading of
    `hydra.mode` (a whole composition of its own) is answered from the check's config."""
    import importlib

    # observed, not used: only cli/hydra_adapter.py imports Hydra's internals (test_module_boundaries)
    target = "hydra._internal.hydra.Hydra.compose_config"
    composing, calls = importlib.import_module("hydra._internal.hydra").Hydra.compose_config, []

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("run_mode"))
        return composing(self, *args, **kwargs)

    monkeypatch.setattr(target, counted)
    where = [f"hydra.sweep.dir={tmp_path}", "-m"] if multirun else [f"hydra.run.dir={tmp_path}"]
    assert run(["pipeline=serial", *where]) == 0
    assert "plan: serial" in capsys.readouterr().out
    assert len(calls) == 2, calls  # the check, then the run (a sweep: its job composes apart)


def test_structure_only_mode(tmp_path, capsys):
    assert recsys_plan(tmp_path, "check_fns=false", "pipeline.tasks.forward.fn=not_imported_xyz:forward") == 0


def _user_conf(tmp_path: Path, name: str, body: str) -> str:
    conf = tmp_path / "user_conf"
    (conf / "pipeline").mkdir(parents=True, exist_ok=True)
    (conf / "pipeline" / f"{name}.yaml").write_text(body)
    return f"hydra.searchpath=[file://{conf}]"


def test_user_plan_file_extends_a_shipped_plan(tmp_path, capsys):
    searchpath = _user_conf(
        tmp_path,
        "my_plan",
        """\
defaults:
  - hstu_sparse_dist
  - _self_
name: my_plan
tasks:
  aux_stats:
    fn: recsys_pipe.train.tasks:zero_grad
    stream: memcpy
    lookahead: 2
    cross_iter_depends_on: [h2d]
""",
    )
    assert recsys_plan(tmp_path / "run", searchpath, "pipeline=my_plan") == 0
    out = capsys.readouterr().out
    assert "plan: my_plan" in out
    assert re.search(r"\baux_stats +2 +memcpy", out)


def test_typo_in_a_plan_file_is_refused_with_its_path(tmp_path, capsys):
    searchpath = _user_conf(
        tmp_path, "typo_plan", "defaults:\n  - serial\n  - _self_\ntasks:\n  h2d:\n    lookahed: 1\n"
    )
    assert recsys_plan(tmp_path / "run", searchpath, "pipeline=typo_plan") == 2
    err = capsys.readouterr().err
    assert "pipeline.tasks.h2d.lookahed" in err and "Traceback" not in err


# -- the catalogue of refused configs -------------------------------------------------------------

# (id, overrides, path that must be named, message fragment)
BAD = [
    (
        "unknown-dep",
        ["pipeline.tasks.forward.depends_on=[fwd]"],
        "pipeline.tasks.forward.depends_on[0]",
        "unknown task 'fwd'",
    ),
    (
        "unknown-sync",
        ["pipeline.tasks.backward.same_progress_sync=[prefetch]"],
        "pipeline.tasks.backward.same_progress_sync[0]",
        "unknown task 'prefetch'",
    ),
    (
        "unknown-cross-iter",
        ["pipeline.tasks.h2d.cross_iter_depends_on=[h2e]"],
        "pipeline.tasks.h2d.cross_iter_depends_on[0]",
        "did you mean 'h2d'",
    ),
    ("cycle", ["pipeline.tasks.zero_grad.depends_on=[forward]"], "pipeline.tasks.", "cyclic dependency"),
    ("cycle-sync", ["pipeline.tasks.forward.same_progress_sync=[backward]"], "pipeline.tasks.", "cyclic dependency"),
    ("self-dep", ["pipeline.tasks.forward.depends_on=[forward]"], "pipeline.tasks.forward.depends_on[0]", "itself"),
    ("unknown-stream", ["pipeline.tasks.h2d.stream=memcopy"], "pipeline.tasks.h2d.stream", "did you mean 'memcpy'"),
    ("stream-twice", ["pipeline.streams=[default,memcpy,memcpy,data_dist]"], "pipeline.streams[2]", "listed twice"),
    (
        "name-in-two-fields",
        ["pipeline.tasks.forward.same_progress_sync=[zero_grad]"],
        "pipeline.tasks.forward.",
        "only one of",
    ),
    (
        "cross-iter-delta-negative",
        ["pipeline.tasks.h2d.cross_iter_depends_on=[optimizer_step]"],
        "pipeline.tasks.h2d.cross_iter_depends_on[0]",
        "future read",
    ),
    (
        "cross-iter-offset-positive",
        ["pipeline.tasks.forward.cross_iter_depends_on=[[h2d,1]]"],
        "pipeline.tasks.forward.cross_iter_depends_on[0]",
        "negative",
    ),
    (
        "cross-stream-out-of-ring",
        ["pipeline.tasks.h2d.cross_iter_depends_on=[[start_input_dist,-3]]"],
        "pipeline.tasks.h2d.cross_iter_depends_on[0]",
        "rotated out of the ring",
    ),
    (
        "two-waits-different-offsets",
        ["pipeline.tasks.start_input_dist.cross_iter_depends_on=[h2d]"],
        "pipeline.tasks.start_input_dist.cross_iter_depends_on[0]",
        "waited on twice",
    ),
    (
        "depends-on-future-read",
        ["pipeline.tasks.h2d.depends_on=[zero_grad]"],
        "pipeline.tasks.h2d.depends_on[0]",
        "future read",
    ),
    (
        "slot-future-read",
        ["pipeline.tasks.start_input_dist.reads=[[model_out,1]]"],
        "pipeline.tasks.start_input_dist.reads[0]",
        "future read",
    ),
    (
        "slot-never-written",
        ["pipeline.tasks.forward.reads=[no_such_slot]"],
        "pipeline.tasks.forward.reads[0]",
        "no task writes slot 'no_such_slot'",
    ),
    (
        "slot-two-writers",
        ["pipeline.tasks.backward.writes=[loss]"],
        "pipeline.tasks.backward.writes[0]",
        "at most one writer",
    ),
    ("slot-reserved", ["pipeline.tasks.h2d.writes=[batch_cpu]"], "pipeline.tasks.h2d.writes[0]", "reserved"),
    (
        "slot-negative-offset",
        ["pipeline.tasks.forward.reads=[[batch_gpu,-1]]"],
        "pipeline.tasks.forward.reads[0]",
        ">= 0",
    ),
    (
        "slot-bad-shape",
        ["pipeline.tasks.forward.reads=[[batch_gpu,1,2]]"],
        "pipeline.tasks.forward.reads[0]",
        "[name, batch_offset]",
    ),
    (
        "fn-no-attribute",
        ["pipeline.tasks.forward.fn=recsys_pipe.train.tasks:fwd"],
        "pipeline.tasks.forward.fn",
        "has no attribute 'fwd'",
    ),
    (
        "fn-no-module",
        ["pipeline.tasks.forward.fn=no_such_pkg_xyz.tasks:forward"],
        "pipeline.tasks.forward.fn",
        "No module named 'no_such_pkg_xyz'",
    ),
    ("fn-not-a-path", ["pipeline.tasks.forward.fn=my_pkg..forward"], "pipeline.tasks.forward.fn", "not an import path"),
    (
        "fn-unknown-task-name",
        ["pipeline.tasks.forward.fn=forwrd"],
        "pipeline.tasks.forward.fn",
        "unknown task 'forwrd' (did you mean 'forward'?)",
    ),
    ("typo-key-plus", ["+pipeline.tasks.h2d.lookahed=3"], "pipeline.tasks.h2d.lookahed", "did you mean 'lookahead'"),
    ("typo-key-override", ["pipeline.tasks.h2d.lookahed=3"], "pipeline.tasks.h2d.lookahed", "lookahed"),
    ("typo-plan-key", ["+pipeline.executer=threaded"], "pipeline.executer", "did you mean 'executor'"),
    ("typo-trainer-key", ["+trainer.max_step=3"], "trainer.max_step", "did you mean 'max_steps'"),
    ("lookahead-not-int", ["pipeline.tasks.h2d.lookahead=two"], "pipeline.tasks.h2d.lookahead", "integer"),
    ("lookahead-float", ["pipeline.tasks.h2d.lookahead=1.5"], "pipeline.tasks.h2d.lookahead", "integer"),
    (
        "lookahead-negative",
        ["pipeline.tasks.h2d.lookahead=-1"],
        "pipeline.tasks.h2d.lookahead",
        "greater than or equal to 0",
    ),
    ("nccl-not-bool", ["pipeline.tasks.backward.nccl=maybe"], "pipeline.tasks.backward.nccl", "boolean"),
    (
        "depends-on-not-list",
        ["pipeline.tasks.forward.depends_on=zero_grad"],
        "pipeline.tasks.forward.depends_on",
        "list",
    ),
    ("executor-unknown", ["pipeline.executor=parallel"], "pipeline.executor", "'sequential' or 'threaded'"),
    ("thread-map-strategy", ["pipeline.thread_map.strategy=round_robin"], "pipeline.thread_map.strategy", "by_stream"),
    (
        "thread-map-unknown-task",
        ["+pipeline.thread_map.map.fwd=io"],
        "pipeline.thread_map.map.fwd",
        "unknown task 'fwd'",
    ),
    (
        "thread-map-map-without-dict",
        ["thread_map=per_task", "+pipeline.thread_map.map.h2d=io"],
        "pipeline.thread_map",
        "only used with strategy 'dict'",
    ),
    ("thread-empty", ["pipeline.tasks.forward.thread=''"], "pipeline.tasks.forward.thread", "at least 1 character"),
    ("fn-missing", ["pipeline.tasks.forward.fn=???"], "pipeline.tasks.forward.fn", "missing required value"),
    ("bad-interpolation", ["pipeline.description=${nope}"], "pipeline.description", "nope"),
    ("num-batches", ["num_batches=0"], "num_batches", "greater than or equal to 1"),
    (
        "unknown-pipeline-option",
        ["pipeline=nope"],
        "error: pipeline: no option 'nope'",
        "hstu_prefetch, hstu_prefetch_balanced",
    ),
    (
        "unknown-thread-map-option",
        ["thread_map=round_robin"],
        "error: thread_map: no option 'round_robin'",
        "options: by_stream",
    ),
    ("override-syntax", ["pipeline.tasks.h2d.lookahead=["], "", "no viable alternative"),
]


@pytest.mark.parametrize("overrides,path,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_exits_2_naming_the_path(tmp_path, capsys, overrides, path, fragment):
    assert recsys_plan(tmp_path, *overrides) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert path in err, err
    assert fragment in err, err
    assert "Traceback" not in err
    assert "in-flight batches" not in captured.out  # nothing was compiled/printed as a plan


def test_catalogue_is_big_enough():
    assert len(BAD) >= 30


def test_error_lines_are_one_per_problem(tmp_path, capsys):
    code = recsys_plan(
        tmp_path,
        "pipeline=hstu_sparse_dist",  # the task and stream lists below are this plan's
        "pipeline.tasks.forward.depends_on=[fwd]",
        "pipeline.tasks.h2d.stream=memcopy",
    )
    assert code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert lines == [
        "error: pipeline.tasks.h2d.stream: unknown stream 'memcopy' (did you mean 'memcpy'?); declared in "
        "pipeline.streams: default, memcpy, data_dist",
        "error: pipeline.tasks.forward.depends_on[0]: unknown task 'fwd' (did you mean 'forward'?) (known: h2d, "
        "start_input_dist, wait_input_dist, zero_grad, forward, backward, "
        "finalize_model_grads, optimizer_step)",
    ]
    assert "recsys-plan: 2 config errors" in err


def test_debug_true_shows_traceback(tmp_path, capsys):
    assert recsys_plan(tmp_path, "pipeline.tasks.forward.depends_on=[fwd]", "debug=true") == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "error: pipeline.tasks.forward.depends_on[0]" in err


# -- the installed console script -----------------------------------------------------------------


def _script(tmp_path: Path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [RECSYS_PLAN, *argv, f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_console_script_ok(tmp_path):
    """(It does not import torchmetrics, and with it matplotlib's pyplot: only runs that evaluate do.)"""
    proc = _script(tmp_path, "pipeline=serial", env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "plan: serial" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "recsys_pipe.train.evaluation" in imported and "torchmetrics" not in imported


def test_console_script_plan_error_exit_2(tmp_path):
    proc = _script(tmp_path, "pipeline.tasks.forward.depends_on=[fwd]")
    assert proc.returncode == 2
    assert "error: pipeline.tasks.forward.depends_on[0]: unknown task 'fwd'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_console_script_hydra_error_exit_2_full_error_traceback(tmp_path):
    proc = _script(tmp_path, "pipeline=nope")
    assert proc.returncode == 2 and "error: pipeline: no option 'nope'" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _script(tmp_path, "pipeline.tasks.forward.depends_on=[fwd]", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 2 and "Traceback" in proc.stderr


# -- costs: simulate and tune ---------------------------------------------------------------------

COSTS_MS = {
    "h2d": 2.0,
    "start_input_dist": 1.0,
    "wait_input_dist": 2.0,
    "zero_grad": 0.2,
    "forward": 4.0,
    "backward": 6.0,
    "finalize_model_grads": 0.1,
    "optimizer_step": 1.0,
}


def _costs(tmp_path: Path, drop: str | None = None) -> Path:
    import json

    tasks = {n: {"cpu_s": ms / 1e3, "device_s": 0.0} for n, ms in COSTS_MS.items() if n != drop}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"tasks": tasks}))
    return path


def test_costs_print_the_simulated_step(tmp_path, capsys):
    assert recsys_plan(tmp_path, "pipeline=serial", f"costs={_costs(tmp_path)}") == 0
    out = capsys.readouterr().out
    # one thread runs every task in turn: the step is the sum of the costs
    assert f"predicted step: {sum(COSTS_MS.values()):.4g} ms" in out
    assert "critical path" in out


def test_tuned_prefetch_plan_keeps_its_torchrec_context(tmp_path, capsys):
    import json

    from recsys_pipe.testing import load_run
    from recsys_pipe.train import training_plan

    costs = _costs(tmp_path)
    data = json.loads(costs.read_text())
    data["tasks"]["prefetch_embeddings"] = {"cpu_s": 0.0005, "device_s": 0.0}
    costs.write_text(json.dumps(data))
    assert recsys_plan(tmp_path, "pipeline=hstu_prefetch", f"costs={costs}", "tune=true", "tune_time_limit_s=3") == 0
    tuned = training_plan(
        load_run("pipeline=hstu_prefetch_tuned", "thread_map=plan", f"hydra.searchpath=[file://{tmp_path}]")
    )
    assert tuned.config.torchrec_context == "prefetch"


def test_tune_writes_a_plan_file_that_loads_as_tuned(tmp_path, capsys):
    from recsys_pipe.testing import load_run
    from recsys_pipe.train import training_plan

    code = recsys_plan(
        tmp_path, "pipeline=hstu_sparse_dist", f"costs={_costs(tmp_path)}", "tune=true", "tune_time_limit_s=5"
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "predicted step of the configured plan 'hstu_sparse_dist': 14.3 ms" in out
    best = float(re.search(r"predicted step of the best plan found 'hstu_sparse_dist_tuned': ([\d.]+) ms", out)[1])
    assert best <= 14.3
    written = tmp_path / "pipeline" / "hstu_sparse_dist_tuned.yaml"
    assert f"hydra.searchpath=[file://{tmp_path.resolve()}]" in out
    from omegaconf import OmegaConf

    declared = OmegaConf.to_container(OmegaConf.load(written))["tasks"]
    tuned = training_plan(
        load_run("pipeline=hstu_sparse_dist_tuned", "thread_map=plan", f"hydra.searchpath=[file://{tmp_path}]")
    )
    assert [t.name for t in tuned.order] and set(declared) == set(tuned.thread_of)
    for t in tuned.order:  # the plan that loads is the plan in the file
        assert tuned.thread_of[t.name] == declared[t.name]["thread"]
        assert t.lookahead == declared[t.name].get("lookahead", 0)
        assert t.stream == declared[t.name].get("stream", "default")


@pytest.mark.parametrize(
    "args, path, fragment",
    [
        (["tune=true"], "tune", "tune=true needs costs=<costs.json>"),
        (["costs=/nonexistent/costs.json"], "costs", "cannot read cost model"),
        (["costs={costs_without_forward}"], "costs", "has no cost for task(s) forward"),
    ],
)
def test_bad_costs_are_config_errors(tmp_path, capsys, args, path, fragment):
    missing = _costs(tmp_path, drop="forward")
    args = [a.replace("{costs_without_forward}", str(missing)) for a in args]
    assert recsys_plan(tmp_path, *args) == 2
    err = capsys.readouterr().err
    assert f"error: {path}: " in err and fragment in err and "Traceback" not in err


@pytest.mark.parametrize("pipeline", ["prefetch", "hstu_prefetch"])
def test_cpu_prefetch_layout(tmp_path, capsys, pipeline):
    """On the CPU the prefetch plans wait for the next batch's input dist after the forward and
    prefetch after the backward (nothing to warm; gloo's all-to-all then overlaps the backward,
    not the forward); planned for a GPU they keep torchrec's layout. Training parity of both
    layouts: test_train_parity (CPU) and the CUDA family tests."""

    def order(device: str) -> list[str]:
        out = tmp_path / device
        assert recsys_plan(out, f"pipeline={pipeline}", f"trainer.device={device}") == 0
        text = (out / "plan.txt").read_text().split("tasks, in topological order", 1)[1]
        rows = text.split("\n\n", 1)[0].splitlines()[3:]
        return [row.split()[1] for row in rows if row.strip() and row.split()[0].isdigit()]

    cpu, gpu = order("cpu"), order("cuda")
    assert sorted(cpu) == sorted(gpu)
    assert (
        gpu.index("wait_input_dist") < gpu.index("forward") < gpu.index("prefetch_embeddings") < gpu.index("backward")
    )
    assert (
        cpu.index("forward") < cpu.index("wait_input_dist") < cpu.index("backward") < cpu.index("prefetch_embeddings")
    )
