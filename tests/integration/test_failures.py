"""Every failure is a clear message and nothing hangs.

- The catalogue of bad inputs: each is refused by `recsys-train` with exit code 2 and one line
  naming the key (or the file and line), before any process group starts, without a traceback
  (the model/data/optimizer value errors of test_config_errors.py complete it).
- Fuzzing: random plans through the compiler, random MovieLens files through the reader.
- Faults after start-up on 2 ranks (a rank killed, raising, failing a collective or hanging;
  an undeclared collective; Ctrl-C), each bounded in time, and run directories of sweeps and
  concurrent runs.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from recsys_pipe.cli import train as train_cli
from recsys_pipe.config import ConfigError, TaskConfig, compile_plan, structure_only
from recsys_pipe.data import CriteoDataConfig, MovieLensDataConfig, RankData
from recsys_pipe.testing import FAULT_ENV, FAULT_OVERRIDE, fork_ranks, worker_env
from recsys_pipe.train.config import load_run_config


def _write(name: str, content: str | bytes):
    def make(tmp: Path) -> str:
        path = tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    return make


def _ml(rows: int) -> str:
    return "".join(f"{u}::{m}::4::{1000 + m}\n" for u in range(rows) for m in range(5))


def _unreadable(tmp: Path) -> str:
    """A file this process cannot read: mode 000, or (as root, who may read anything) a
    /proc file whose read fails."""
    if os.geteuid() == 0:
        return "/proc/self/mem"
    path = tmp / "secret.dat"
    path.write_text(_ml(10))
    path.chmod(0)
    return str(path)


def _used_run_dir(tmp: Path) -> str:
    (tmp / "taken").mkdir()
    (tmp / "taken" / "status.json").write_text('{"status": "completed"}')
    return str(tmp / "taken")


def _partial_checkpoint(tmp: Path) -> str:
    path = tmp / "run" / "checkpoints" / ".step_9.partial"
    path.mkdir(parents=True)
    return str(path)


def _run_without_checkpoints(tmp: Path) -> str:
    (tmp / "run").mkdir()
    return str(tmp / "run")


def _a_file(tmp: Path) -> str:
    (tmp / "plain.txt").write_text("not a directory")
    return str(tmp / "plain.txt")


def _plan_file(text: str):
    """A config dir holding pipeline/mine.yaml with `text` (for hydra.searchpath)."""

    def make(tmp: Path) -> str:
        (tmp / "conf" / "pipeline").mkdir(parents=True)
        (tmp / "conf" / "pipeline" / "mine.yaml").write_text(text)
        return str(tmp / "conf")

    return make


PLAN_TYPO = "defaults: [serial, _self_]\nname: mine\ntasks:\n  h2d:\n    lookahaed: 1\n"
PLAN_BROKEN = "defaults: [serial, _self_]\nname: mine\ntasks:\n  h2d:\n    lookahead: [1\n    stream: x\n"


def _checkpoint(damage: str):
    """A small DCP checkpoint (written without a process group) in a run directory whose
    config.yaml names model 'dlrm', damaged as `damage` says."""

    def make(tmp: Path) -> str:
        import torch
        import torch.distributed.checkpoint as dcp

        run = tmp / "old_run"
        path = run / "checkpoints" / "step_4"
        dcp.save({"train": {"model": {"w": torch.zeros(64, 8)}}}, checkpoint_id=str(path))
        (run / "config.yaml").write_text("model:\n  name: dlrm\n")
        (data,) = path.glob("*.distcp")
        if damage == "missing file":
            data.unlink()
        elif damage == "truncated file":
            data.write_bytes(data.read_bytes()[:100])
        elif damage == "truncated metadata":
            (path / ".metadata").write_bytes((path / ".metadata").read_bytes()[:50])
        return str(path)

    return make


ML = ["data=movielens", "data.batch_size=2", "data.max_seq_len=4", "data.num_candidates=1", "trainer.eval_batches=0"]
# (id, overrides (a callable gets the tmp dir and returns the value of `{}` in the override), world size,
#  exit code, config path of the error, message fragment)
CATALOGUE = [
    # data files
    ("empty file", [*ML, "data.path={}"], _write("r.dat", ""), 1, "data.path", "r.dat: the file is empty"),
    (
        "header only",
        [*ML, "data.path={}"],
        _write("r.csv", "userId,movieId,rating,timestamp\n"),
        1,
        "data.path",
        "has no ratings (header only)",
    ),
    (
        "short row (ml-1m)",
        [*ML, "data.path={}"],
        _write("r.dat", "1::2::4::100\n1::3::5::101\n1::4::3\n"),
        1,
        "data.path",
        "r.dat:3: expected 4 fields (user, movie, rating, timestamp), got 3",
    ),
    (
        "short row (csv)",
        [*ML, "data.path={}"],
        _write("r.csv", "userId,movieId,rating,timestamp\n1,2,4,100\n1,3\n"),
        1,
        "data.path",
        "r.csv:3: expected 4 fields",
    ),
    (
        "binary file",
        [*ML, "data.path={}"],
        _write("r.dat", bytes(range(256)) * 8),
        1,
        "data.path",
        "r.dat: a binary file, not text",
    ),
    (
        "not a number",
        [*ML, "data.path={}"],
        _write("r.dat", "1::2::4::100\n2::3::five::101\n"),
        1,
        "data.path",
        "r.dat:2: fields must be integer user, movie, timestamp and a numeric rating",
    ),
    (
        "rating out of range",
        [*ML, "data.path={}"],
        _write("r.dat", "1::2::7::100\n"),
        1,
        "data.path",
        "r.dat:1: rating '7'",
    ),
    ("rating nan", [*ML, "data.path={}"], _write("r.dat", "1::2::nan::100\n"), 1, "data.path", "outside (0, 5]"),
    (
        "negative timestamp",
        [*ML, "data.path={}"],
        _write("r.dat", "1::2::4::-5\n"),
        1,
        "data.path",
        "r.dat:1: timestamp '-5' is not a unix time",
    ),
    (
        "another csv",
        [*ML, "data.path={}"],
        _write("movies.csv", "movieId,title\n1,Toy Story\n"),
        1,
        "data.path",
        "movies.csv:1: unrecognised first line",
    ),
    (
        "too small for one batch per rank",
        [*ML, "data.path={}", "data.batch_size=4"],
        _write("r.dat", _ml(3)),
        2,
        "data.path",
        "too little data: rank 1 of 2 gets 1 samples, fewer than one training batch (data.batch_size=4)",
    ),
    (
        "too small with held-out batches",
        [*ML, "data.path={}", "trainer.eval_batches=3"],
        _write("r.dat", _ml(6)),
        1,
        "data.path",
        "plus trainer.eval_batches=3 held-out batches",
    ),
    ("unreadable file", [*ML, "data.path={}"], _unreadable, 1, "data.path", "cannot read"),
    (
        "a directory",
        [*ML, "data.path={}"],
        lambda tmp: str(tmp),
        1,
        "data.path",
        "is a directory; data.path names a file",
    ),
    (
        "num_batches beyond the share",
        ["data.num_batches=40000"],
        None,
        2,
        "data.num_batches",
        "40000 batches x data.batch_size=32 plus trainer.eval_batches=8",
    ),
    (
        "synthetic world too small",
        ["data.synthetic.num_samples=100", "data.num_batches=null"],
        None,
        2,
        "data.synthetic.num_samples",
        "too little data: rank 1 of 2 gets 50 samples",
    ),
    # output paths and run directories
    ("output dir under /proc", ["trainer.output_dir=/proc/x"], None, 1, "trainer.output_dir", "cannot create"),
    (
        "output dir is a file",
        ["trainer.output_dir={}"],
        _a_file,
        1,
        "trainer.output_dir",
        "cannot create run directories",
    ),
    ("run dir used before", ["hydra.run.dir={}"], _used_run_dir, 1, "hydra.run.dir", "already holds a run"),
    # resume
    ("resume from nowhere", ["trainer.resume_from=/no/such/run"], None, 1, "trainer.resume_from", "no such checkpoint"),
    (
        "resume from a run without checkpoints",
        ["trainer.resume_from={}"],
        _run_without_checkpoints,
        1,
        "trainer.resume_from",
        "holds no complete checkpoint",
    ),
    (
        "resume from a half-written checkpoint",
        ["trainer.resume_from={}"],
        _partial_checkpoint,
        1,
        "trainer.resume_from",
        "incomplete checkpoint",
    ),
    ("resume_from empty", ["trainer.resume_from=''"], None, 1, "trainer.resume_from", "at least 1 character"),
    # lifecycle settings
    ("epochs 0", ["trainer.epochs=0"], None, 1, "trainer.epochs", "greater than or equal to 1"),
    (
        "negative interval",
        ["trainer.checkpoint.interval=-1"],
        None,
        1,
        "trainer.checkpoint.interval",
        "greater than or equal to 0",
    ),
    (
        "keep_latest negative",
        ["trainer.checkpoint.keep_latest=-1"],
        None,
        1,
        "trainer.checkpoint.keep_latest",
        "greater than or equal to 0",
    ),
    ("async not a bool", ["trainer.checkpoint.async=maybe"], None, 1, "trainer.checkpoint.async", "valid boolean"),
    ("unknown checkpoint key", ["+trainer.checkpoint.every=5"], None, 1, "trainer.checkpoint.every", "unknown key"),
    ("schedule name", ["optimizer.schedule=exp"], None, 1, "optimizer.schedule", "'constant', 'linear' or 'cosine'"),
    ("warmup negative", ["optimizer.warmup_steps=-5"], None, 1, "optimizer.warmup_steps", "greater than or equal to 0"),
    ("decay_steps 0", ["optimizer.decay_steps=0"], None, 1, "optimizer.decay_steps", "greater than or equal to 1"),
    (
        "min_lr_ratio above 1",
        ["optimizer.min_lr_ratio=2"],
        None,
        1,
        "optimizer.min_lr_ratio",
        "less than or equal to 1",
    ),
    ("clip 0", ["optimizer.clip_grad_norm=0"], None, 1, "optimizer.clip_grad_norm", "greater than 0"),
    ("precision", ["trainer.precision=fp8"], None, 1, "trainer.precision", "'fp32' or 'bf16'"),
    ("peer timeout 0", ["trainer.peer_timeout_s=0"], None, 1, "trainer.peer_timeout_s", "greater than 0"),
    ("verify mode", ["trainer.verify_collectives=sometimes"], None, 1, "trainer.verify_collectives", "'startup'"),
    ("cuda without a GPU", ["trainer.device=cuda"], None, 1, "trainer.device", "no CUDA device is visible"),
    # cross-field values
    (
        "thread_map dict on a by_stream plan",
        ["pipeline.thread_map.strategy=by_stream"],
        None,
        1,
        "pipeline.thread_map",
        "only used with strategy 'dict'",
    ),
    (
        "a task's unknown stream",
        ["pipeline.tasks.h2d.stream=nope"],
        None,
        1,
        "pipeline.tasks.h2d.stream",
        "unknown stream 'nope'",
    ),
    # unknown keys anywhere: the full path and the closest valid keys, never Hydra's `+` advice
    (
        "misspelled trainer key",
        ["trainer.max_step=10"],
        None,
        1,
        "trainer.max_step",
        "unknown key (did you mean trainer.max_steps?)",
    ),
    ("misspelled model key", ["model.embeding_dim=64"], None, 1, "model.embeding_dim", "model.embedding_dim?"),
    (
        "misspelled task field",
        ["pipeline.tasks.h2d.lookahed=2"],
        None,
        1,
        "pipeline.tasks.h2d.lookahed",
        "(did you mean pipeline.tasks.h2d.lookahead?)",
    ),
    (
        "misspelled task name",
        ["pipeline.tasks.h2dd.lookahead=2"],
        None,
        1,
        "pipeline.tasks.h2dd",
        "(did you mean pipeline.tasks.h2d?)",
    ),
    ("misspelled group", ["pipline=serial"], None, 1, "pipline", "unknown key (did you mean pipeline?)"),
    ("misspelled data key", ["data=movielens", "data.pth=/x"], None, 1, "data.pth", "(did you mean data.path?)"),
    ("a key in another section", ["trainer.lr=0.1"], None, 1, "trainer.lr", "(did you mean optimizer.lr"),
    (
        "misspelled key in a plan file",
        ["hydra.searchpath=[file://{}]", "pipeline=mine"],
        _plan_file(PLAN_TYPO),
        1,
        "pipeline.tasks.h2d.lookahaed",
        "conf/pipeline/mine.yaml:5 (did you mean pipeline.tasks.h2d.lookahead?)",
    ),
    (
        "YAML syntax error in a plan file",
        ["hydra.searchpath=[file://{}]", "pipeline=mine"],
        _plan_file(PLAN_BROKEN),
        1,
        "{tmp}/conf/pipeline/mine.yaml:6:11: ",
        "expected ',' or ']', but got ':'",
    ),
    (
        "unknown group option",
        ["optimizer=adamx"],
        None,
        1,
        "optimizer",
        "no option 'adamx' (did you mean optimizer=adam",
    ),
    ("override syntax", ["trainer.max_steps=["], None, 1, "override 'trainer.max_steps=['", "no viable alternative"),
    # the machine and the trainer's own settings
    ("nccl without CUDA", ["trainer.backend=nccl"], None, 1, "trainer.backend", "nccl needs CUDA"),
    (
        "profiler window past max_steps",
        ["trainer.max_steps=5", "trainer.torch_profiler.steps=[3,8]"],
        None,
        1,
        "trainer.torch_profiler.steps",
        "ends after the last step (trainer.max_steps=5)",
    ),
    # Criteo files that are no Criteo text
    (
        "binary criteo file",
        ["model=dlrm", "data=criteo", "data.path={}"],
        _write("day_0.gz", b"\x1f\x8b\x08\x00" + bytes(range(256))),
        1,
        "data.path",
        "day_0.gz: a binary file, not text",
    ),
    (
        "empty criteo file",
        ["model=dlrm", "data=criteo", "data.path={}"],
        _write("day_0", ""),
        1,
        "data.path",
        "day_0: the file is empty",
    ),
    # checkpoints that cannot fit, found from their own files before any process group starts
    (
        "checkpoint of another model",
        ["trainer.resume_from={}"],
        _checkpoint("none"),
        1,
        "trainer.resume_from",
        "it holds model 'dlrm' (its run's config.yaml), this run trains 'hstu'",
    ),
    (
        "checkpoint data file missing",
        ["trainer.resume_from={}"],
        _checkpoint("missing file"),
        1,
        "trainer.resume_from",
        "its data file __0_0.distcp is missing",
    ),
    (
        "checkpoint data file truncated",
        ["trainer.resume_from={}"],
        _checkpoint("truncated file"),
        1,
        "trainer.resume_from",
        "its data file __0_0.distcp is truncated (100 of",
    ),
    (
        "checkpoint metadata truncated",
        ["trainer.resume_from={}"],
        _checkpoint("truncated metadata"),
        1,
        "trainer.resume_from",
        "its .metadata cannot be read",
    ),
    (
        "a future read",
        ["pipeline.tasks.h2d.lookahead=0"],
        None,
        1,
        "pipeline.tasks.start_input_dist.reads[0]",
        "future read: slot 'batch_gpu' is read at offset 1",
    ),
]


def test_the_catalogue_is_large_enough():
    assert len(CATALOGUE) >= 40
    assert len({case[0] for case in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, overrides, make, world, path, fragment", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_bad_input_exits_2_naming_its_key(
    name, overrides, make, world, path, fragment, tmp_path, capsys, monkeypatch, no_process_group
):
    if world > 1:  # what rank 1 of a torchrun job checks before the process group starts
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", "1")
    value = make(tmp_path) if make else None
    argv = [o.format(value) if "{}" in o else o for o in overrides]
    if not any(a.startswith("trainer.output_dir") for a in argv):
        argv.append(f"trainer.output_dir={tmp_path}/runs")
    code = train_cli.run(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert lines and lines[0].startswith(f"error: {path.format(tmp=tmp_path)}"), err
    assert "use +" not in err and "To append" not in err  # never Hydra's advice to add the key
    assert fragment in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "runs" / "recsys-train").exists()  # nothing started, no run directory


# -- unknown keys typed at random ---------------------------------------------------------------


def _schema_keys() -> list[str]:
    """Every key of the default recsys-train config (the chosen components' keys), task fields
    spelled out for some tasks of the default plan."""
    from recsys_pipe.cli.keys import describe_keys
    from recsys_pipe.config import to_container
    from recsys_pipe.testing import compose
    from recsys_pipe.train.config import RunConfig

    values = to_container(compose(config_name="train"))
    tasks = list(values["pipeline"]["tasks"])[:3]
    paths = []
    for path, _, _ in describe_keys(RunConfig, values):
        paths += [path.replace("<name>", t) for t in tasks] if "<name>" in path else [path]
    return paths


KEYS = _schema_keys()
LETTERS = "abcdefghijklmnopqrstuvwxyz_"


def _near_miss(word: str, kind: str, position: int, letter: str) -> str:
    """`word` with one typo: a letter dropped, added, replaced, or two swapped."""
    i = position % len(word)
    if kind == "drop":
        return word[:i] + word[i + 1 :]
    if kind == "add":
        return word[:i] + letter + word[i:]
    if kind == "replace":
        return word[:i] + letter + word[i + 1 :]
    j = min(i + 1, len(word) - 1)
    return word[:i] + word[j] + word[i + 1 : j] + word[i] + word[j + 1 :] if j > i else word


typo = st.tuples(st.sampled_from(["drop", "add", "replace", "swap"]), st.integers(0, 40), st.sampled_from(LETTERS))


def _siblings(path: str) -> set[str]:
    parent = path.rpartition(".")[0]
    return {k.rpartition(".")[2] for k in KEYS if k.rpartition(".")[0] == parent}


def _suggested(err: str, bad: str) -> list[str]:
    (line,) = [x for x in err.splitlines() if x.startswith(f"error: {bad}: unknown key")]
    match = re.search(r"\(did you mean (.+)\?\)", line)
    assert match, line
    return re.split(r", | or ", match.group(1))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEYS), edit=typo)
def test_a_misspelled_key_on_the_command_line_gets_the_right_suggestion(key, edit, capsys, no_process_group):
    parent, _, leaf = key.rpartition(".")
    wrong = _near_miss(leaf, *edit)
    assume(len(wrong) >= 2 and wrong not in _siblings(key) and wrong not in {"hydra"})
    bad = f"{parent}.{wrong}" if parent else wrong
    code = train_cli.run([f"{bad}=1", "trainer.output_dir=/nonexistent/never"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert key in _suggested(err, bad), err
    assert "Traceback" not in err and "use +" not in err


TASK_FIELDS = sorted(TaskConfig.model_fields)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(task=st.sampled_from(["h2d", "forward", "backward"]), field=st.sampled_from(TASK_FIELDS), edit=typo)
@example(task="h2d", field="fn", edit=("replace", 0, "o"))  # `on:` is YAML's boolean true
def test_a_misspelled_key_in_a_plan_file_gets_the_right_suggestion(task, field, edit, tmp_path, capsys):
    wrong = _near_miss(field, *edit)
    assume(len(wrong) >= 2 and wrong not in TASK_FIELDS)
    conf = Path(tempfile.mkdtemp(dir=tmp_path))
    (conf / "pipeline").mkdir()
    plan_file = conf / "pipeline" / "mine.yaml"
    plan_file.write_text(f"defaults: [serial, _self_]\nname: mine\ntasks:\n  {task}:\n    {wrong}: 1\n")
    code = train_cli.run([f"hydra.searchpath=[file://{conf}]", "pipeline=mine", "--cfg", "job"])
    err = capsys.readouterr().err
    bad = f"pipeline.tasks.{task}.{wrong}"
    assert code == 2, err
    assert f"unknown key in {plan_file}:5 " in err, err
    assert f"pipeline.tasks.{task}.{field}" in _suggested(err, bad), err


# -- sweeps, the optimizer group, the other CLIs, data files --------------------------------------


def test_a_sweep_with_a_bad_job_starts_no_job(tmp_path, capsys, no_process_group):
    code = train_cli.run(
        [
            "-m",
            "trainer.max_steps=10",
            "data.batch_size=16,0,8",
            f"hydra.sweep.dir={tmp_path}/sweep",
            f"trainer.output_dir={tmp_path}/runs",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: data.batch_size: Input should be greater than or equal to 1, got 0 [sweep job 1: data.batch_size=0]"
    ], err
    assert "1 of 3 sweep jobs are invalid, no job was started (--keep-going runs the valid ones)" in err
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "runs").exists()  # no job directory at all


@pytest.mark.timeout(300)
def test_keep_going_runs_the_valid_jobs_and_records_the_invalid_one(tmp_path):
    """The explicit opt-in: job 0 is invalid and recorded as failed in its job directory, job 1
    trains; the sweep exits 2. Its stderr is a file, so no progress bar is drawn."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            str(BIN / "recsys-train"),
            "--keep-going",
            "-m",
            "data.batch_size=0,8",
            *SMOKE,
            "trainer.progress_bar=true",
            f"hydra.sweep.dir={sweep}",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
        env=_env(),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    bad, good = _status(sweep / "0"), _status(sweep / "1")
    assert bad["status"] == "failed" and bad["exit_code"] == 2 and "data.batch_size" in bad["message"], bad
    assert bad["overrides"][0] == "data.batch_size=0"
    assert good["status"] == "completed", good
    assert "1 sweep job(s) had an invalid config and did not run (job 0 (data.batch_size=0" in proc.stderr
    assert "\r" not in proc.stderr  # the bar is drawn on a terminal only


def test_a_sweep_checks_each_jobs_data_as_the_job_would_and_starts_none(tmp_path, capsys, no_process_group):
    """Job 1's data file is bad, which shows only once it is read: the sweep reads every job's
    data before the first job starts (as each job checks itself), so no job runs and the line
    names the job."""
    good, bad = tmp_path / "good.dat", tmp_path / "bad.dat"
    good.write_text(_ml(20))
    bad.write_text("1::2::4::100\n1::3\n")
    sweep = tmp_path / "sweep"
    code = train_cli.run(["-m", *ML, f"data.path={good},{bad}", *SMOKE, f"hydra.sweep.dir={sweep}"])
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: data.path: {bad}:2: expected 4 fields (user, movie, rating, timestamp), got 2: ['1', '3'] "
        f"[sweep job 1: data.path={bad}]"
    ]
    assert "1 of 2 sweep jobs are invalid, no job was started" in err and "Traceback" not in err
    assert not sweep.exists()


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "adagrad"])
def test_every_registered_optimizer_is_a_group_option(name):
    from recsys_pipe.testing import compose
    from recsys_pipe.train.optim import OPTIMIZERS

    assert set(OPTIMIZERS.names) == {"sgd", "adam", "adamw", "adagrad"}
    code = train_cli.run([f"optimizer={name}", "optimizer.lr=0.5", "optimizer.sparse.lr=0.25", "--check"])
    assert code == 0
    run = load_run_config(compose(f"optimizer={name}", "++optimizer.lr=0.5", config_name="train"))
    assert run.optimizer.name == name and run.optimizer.lr == 0.5


def test_recsys_profile_checks_its_output_dir_first(tmp_path, capsys, no_process_group):
    from recsys_pipe.cli import profile as profile_cli

    code = profile_cli.run([f"trainer.output_dir={_a_file(tmp_path)}", "trainer=smoke"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: trainer.output_dir: cannot create run directories under"), err
    assert "Traceback" not in err


def test_recsys_plan_writes_under_trainer_output_dir(tmp_path, capsys):
    from recsys_pipe.cli import plan as plan_cli

    assert plan_cli.run([f"trainer.output_dir={tmp_path}/out", "check_fns=false"]) == 0
    (written,) = (tmp_path / "out" / "recsys-plan").glob("*/plan.txt")
    assert "h2d" in written.read_text()
    capsys.readouterr()
    assert plan_cli.run([f"trainer.output_dir={_a_file(tmp_path)}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: trainer.output_dir: cannot create run directories under"), err


def test_a_byte_order_mark_in_a_movielens_csv_is_accepted(tmp_path):
    import codecs

    path = tmp_path / "ratings.csv"
    rows = "\n".join(line.replace("::", ",") for line in VALID)
    path.write_bytes(codecs.BOM_UTF8 + f"userId,movieId,rating,timestamp\n{rows}\n".encode())
    data = RankData(MovieLensDataConfig(path=str(path), batch_size=2, max_seq_len=4, num_candidates=1), 0, 1)
    assert len(list(data.train_loader())) == 2


def test_library_warnings_once_per_job_on_rank_0_and_all_with_debug(recwarn):
    import warnings

    from recsys_pipe.cli.console import show_library_warnings

    def warn_twice() -> int:
        before = len(recwarn)
        for _ in range(2):
            warnings.warn("a library deprecation", FutureWarning, stacklevel=1)
        return len(recwarn) - before

    with warnings.catch_warnings():
        show_library_warnings(0, debug=False)
        assert warn_twice() == 1
        show_library_warnings(0, debug=False)  # the next job of a sweep shows it again, once
        assert warn_twice() == 1
        show_library_warnings(1, debug=False)
        assert warn_twice() == 0
        show_library_warnings(1, debug=True)
        assert warn_twice() >= 1


@pytest.mark.timeout(400)
def test_a_checkpoint_of_another_shape_or_model_is_named_before_dcp_loads(tmp_path):
    """A table of another shape is refused before any process group starts (its shape read from
    the checkpoint's metadata, `check_checkpoint`); other keys (and shapes: tests/unit/
    test_checkpoint_shapes.py) are compared with the metadata in DCP's load planner, before any
    tensor is read: exit 2 and one line naming the table or the parameters that differ."""
    train = ["pipeline=serial", *SMOKE, "trainer.max_steps=2"]  # one rank, forked (`fork_ranks`)
    save = ["trainer.checkpoint.interval=2", f"hydra.run.dir={tmp_path}/old"]
    saved = fork_ranks(BIN / "recsys-train", *train, *save, **ONE_RANK, cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr[-3000:]
    # an explicit hydra.run.dir is the run directory as it is (no recsys-train/<time>/ under it)
    assert _status(tmp_path / "old")["status"] == "completed" and (tmp_path / "old" / "train.log").is_file()
    (tmp_path / "old" / "config.yaml").unlink()  # so that the model is not refused by its name first
    for overrides, fragment in [
        (
            ["model.embedding_dim=64"],
            "table item_table is [1000, 32] (rows, dim) in the checkpoint and [1000, 64] in this config",
        ),
        (["model=dlrm", "data=criteo_synthetic"], "it has no model.model."),
    ]:
        resume = [f"trainer.resume_from={tmp_path}/old", f"trainer.output_dir={tmp_path}/new"]
        proc = fork_ranks(BIN / "recsys-train", *train, *overrides, *resume, **ONE_RANK, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-3000:]
        (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
        assert line.startswith(f"error: trainer.resume_from: checkpoint {tmp_path}/old/checkpoints/step_2 does not fit")
        assert fragment in line, line
        assert "CheckpointException" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(300)
def test_train_sh_checks_the_config_in_one_process_before_torchrun(tmp_path):
    script = Path(__file__).resolve().parents[2] / "scripts" / "train.sh"
    proc = subprocess.run(
        ["bash", str(script), "trainer.max_step=3", f"trainer.output_dir={tmp_path}/r"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
        env=_env(NPROC="2"),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: trainer.max_step: unknown key (did you mean trainer.max_steps?)"], proc.stderr
    assert "ChildFailedError" not in proc.stderr and "torchrun" not in proc.stderr
    helped = subprocess.run(
        ["bash", str(script), "--help"], capture_output=True, text=True, timeout=280, cwd=tmp_path, env=_env()
    )
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert helped.stdout.count("== Keys ==") == 1 and "hstu_prefetch, hstu_prefetch_bal" in helped.stdout
    assert not (tmp_path / "r").exists()


# -- fuzzing ------------------------------------------------------------------------------------

NAMES = ["a", "b", "c", "h2d", "forward"]
SLOTS = ["x", "y", "batch_cpu", "step_result", "loss"]
STREAMS = ["default", "memcpy", "s1", ""]
FNS = [
    "h2d",
    "recsys_pipe.train.tasks:forward",
    "recsys_pipe.train.tasks.forward",
    "recsys_pipe.train.tasks:nope",
    "no_such_package.module:fn",
    "recsys_pipe",
    "os.path:join",
    "",
]
junk = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 5), st.floats(allow_nan=True), st.text(max_size=4), st.just([1, "x"])
)
slot = st.one_of(st.sampled_from(SLOTS), st.tuples(st.sampled_from(SLOTS), st.integers(-2, 4)).map(list), junk)
name = st.one_of(st.sampled_from(NAMES), junk)
cross = st.one_of(name, st.tuples(st.sampled_from(NAMES), st.integers(-3, 2)).map(list))
task = st.fixed_dictionaries(
    {"fn": st.one_of(st.sampled_from(FNS), junk)},
    optional={
        "stream": st.one_of(st.sampled_from(STREAMS), junk),
        "lookahead": st.one_of(st.integers(-1, 4), junk),
        "reads": st.one_of(st.lists(slot, max_size=3), junk),
        "writes": st.lists(slot, max_size=3),
        "depends_on": st.lists(name, max_size=2),
        "cross_iter_depends_on": st.lists(cross, max_size=2),
        "same_progress_sync": st.lists(name, max_size=2),
        "nccl": st.one_of(st.booleans(), junk),
        "thread": st.one_of(st.sampled_from(["io", "compute"]), junk),
        "nvtx_tag": junk,
        "bogus": junk,
    },
)
plan = st.fixed_dictionaries(
    {"tasks": st.one_of(st.dictionaries(st.sampled_from(NAMES), task, max_size=5), junk)},
    optional={
        "streams": st.one_of(st.lists(st.sampled_from(STREAMS), max_size=4), junk),
        "executor": st.sampled_from(["sequential", "threaded", "parallel"]),
        "thread_map": st.fixed_dictionaries(
            {},
            optional={
                "strategy": st.one_of(st.sampled_from(["by_stream", "per_task", "single", "dict"]), junk),
                "map": st.one_of(st.dictionaries(st.sampled_from(NAMES), st.sampled_from(["io", "x"])), junk),
                "default": st.one_of(st.sampled_from(["compute"]), junk),
                "thread": junk,
            },
        ),
        "torchrec_context": st.one_of(st.sampled_from(["base", "prefetch"]), junk),
        "name": junk,
    },
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plan, import_fns=st.booleans())
def test_fuzzed_plans_compile_or_fail_with_config_paths(plan, import_fns):
    """Random task fields, dependency names and offsets, streams and thread maps: the compiler
    returns a plan or a ConfigError whose every problem names a config path, nothing else."""
    try:
        compiled = compile_plan(plan, resolve_fn=None if import_fns else structure_only)
    except ConfigError as exc:
        assert exc.problems
        for problem in exc.problems:
            assert problem.path.startswith("pipeline"), problem
            assert problem.message.strip(), problem
    else:
        assert set(compiled.thread_of) == set(plan["tasks"])


row = st.one_of(
    st.tuples(st.integers(0, 5), st.integers(0, 8), st.sampled_from([0.5, 1.0, 3.5, 5.0]), st.integers(0, 10**9)).map(
        lambda r: "::".join(map(str, r))
    ),
    st.lists(
        st.sampled_from(["1", "2", "-3", "4.5", "nan", "inf", "x", "", " 7 ", "1e3", "99999999999999999999"]),
        max_size=6,
    ).map("::".join),
    st.text(max_size=20),
)
#: a file that loads (4 users with 3 ratings each: 4 windows, 2 batches of 2)
VALID = [f"{u}::{m}::{1 + m % 5}::{100 * u + m}" for u in range(4) for m in range(3)]


def _splice(parts):
    extra, position = parts
    lines = VALID[:position] + extra + VALID[position:]
    return "\n".join(lines)


text_file = st.one_of(
    st.lists(row, max_size=3).map(lambda extra: "\n".join(VALID + extra)),  # often still valid
    st.tuples(st.lists(row, min_size=1, max_size=2), st.integers(0, len(VALID))).map(_splice),  # a bad row inside
    st.lists(row, max_size=12).map("\n".join),
)
ratings = st.one_of(
    text_file.map(lambda text: text.encode("latin-1", errors="replace")),
    text_file.map(
        lambda text: ("userId,movieId,rating,timestamp\n" + text.replace("::", ",")).encode("latin-1", errors="replace")
    ),
    st.binary(max_size=200),
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(content=ratings)
@example(content=b"0::0::1::0\n0::1::2::1\n1::99999999999999999999::1::1\n")  # an id past int64: was an OverflowError
def test_fuzzed_movielens_files_load_or_fail_with_a_file_error(content, tmp_path):
    """Whatever is in the file: the data loads and every batch collates, or a ConfigError at
    data.path says why; never another exception."""
    path = tmp_path / "ratings.dat"
    path.write_bytes(content)
    cfg = MovieLensDataConfig(path=str(path), batch_size=2, max_seq_len=4, num_candidates=1, use_user_feature=True)
    try:
        data = RankData(cfg, 0, 1)
    except ConfigError as exc:
        assert [p.path for p in exc.problems] == ["data.path"], exc
        return
    for batch in data.train_loader(epochs=2):
        assert batch.labels.shape[0] == int(batch.num_candidates.sum())


def test_the_fuzzers_base_file_loads(tmp_path):
    path = tmp_path / "ratings.dat"
    path.write_text("\n".join(VALID))
    data = RankData(MovieLensDataConfig(path=str(path), batch_size=2, max_seq_len=4, num_candidates=1), 0, 1)
    assert len(list(data.train_loader())) == 2


#: Criteo rows: valid ones, and every field of a valid row replaced by fuzz at random
CRITEO_VALID = ["\t".join(["1", *(str(i) for i in range(13)), *(f"{i * 17 + 5:08x}" for i in range(26))])] * 8
criteo_field = st.one_of(
    st.sampled_from(["", "0", "1", "-3", "2.5", "0x1f", "deadbeef", "zz", "\u00e9", "99999999999999999999"]),
    st.text(max_size=10),
)


def _criteo_mutation(parts):
    base, edits = parts
    fields = base.split("\t")
    for index, value in edits:
        if index < len(fields):
            fields[index] = value
        else:
            fields.append(value)
    return "\t".join(fields)


criteo_row = st.one_of(
    st.tuples(st.just(CRITEO_VALID[0]), st.lists(st.tuples(st.integers(0, 41), criteo_field), max_size=3)).map(
        _criteo_mutation
    ),
    st.text(max_size=60),
)
criteo_files = st.one_of(
    st.tuples(st.lists(criteo_row, max_size=3), st.integers(0, len(CRITEO_VALID))).map(
        lambda parts: "\n".join(CRITEO_VALID[: parts[1]] + parts[0] + CRITEO_VALID[parts[1] :]).encode(
            "utf-8", errors="replace"
        )
    ),
    st.binary(max_size=300),
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(content=criteo_files)
def test_fuzzed_criteo_files_load_or_fail_with_a_file_error(content, tmp_path):
    """Whatever is in a Criteo file: the data loads and every batch collates, or a ConfigError at
    data.path says why; never another exception."""
    path = tmp_path / "train.txt"
    path.write_bytes(content)
    cfg = CriteoDataConfig(path=str(path), batch_size=2, num_embeddings=50)
    try:
        data = RankData(cfg, 0, 1)
    except ConfigError as exc:
        assert [p.path for p in exc.problems] == ["data.path"], exc
        return
    for batch in data.train_loader(epochs=2):
        assert batch.labels.shape[0] == 2


def test_the_criteo_fuzzers_base_file_loads(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("\n".join(CRITEO_VALID))
    data = RankData(CriteoDataConfig(path=str(path), batch_size=2, num_embeddings=50), 0, 1)
    assert len(list(data.train_loader())) == 4


# -- --help -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cli", ["recsys-train", "recsys-plan"])
def test_help_describes_every_key_in_one_line(cli, capsys):
    from recsys_pipe.cli import plan as plan_cli
    from recsys_pipe.cli.keys import describe_keys
    from recsys_pipe.cli.plan import PlanCommandConfig
    from recsys_pipe.config import to_container
    from recsys_pipe.testing import compose
    from recsys_pipe.train.config import RunConfig

    run, schema, config = (
        (train_cli.run, RunConfig, "train") if cli == "recsys-train" else (plan_cli.run, PlanCommandConfig, "plan")
    )
    assert run(["--help", "data=movielens", "data.path=/etc/hosts"]) == 0
    out = capsys.readouterr().out
    keys = describe_keys(schema, to_container(compose("data=movielens", "data.path=/etc/hosts", config_name=config)))
    assert len(keys) > 90  # the chosen components (movielens, hstu, adam) add their own keys
    lines = out.split("== Keys ==", 1)[1].splitlines()
    for path, value, description in keys:
        assert description, f"{path} has no description in the schema"
        (line,) = [x for x in lines if x.startswith(f"  {path}=" if value else f"  {path}:")]
        assert line.rstrip().endswith(description[:20]) or description[:30] in line, line
    assert "  data.path=/etc/hosts" in out and "trainer.checkpoint.async=false" in out  # values with overrides
    assert "pipeline.tasks.<name>.lookahead=0" in out  # task fields, once


# -- run directories ----------------------------------------------------------------------------

BIN = Path(sys.executable).parent
SMOKE = ["trainer=smoke", "trainer.max_steps=3", "trainer.eval_every=0", "trainer.tensorboard=false"]


#: `fork_ranks` arguments of a one-rank run
ONE_RANK = {"nproc": 1, "timeout": 180}


def _env(**extra: str) -> dict:
    return worker_env(PATH=f"{BIN}:{os.environ['PATH']}", **extra)


def _status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


@pytest.mark.timeout(200)
def test_runs_started_together_get_their_own_directories(tmp_path):
    procs = [
        subprocess.Popen(
            [str(BIN / "recsys-train"), *SMOKE, f"trainer.output_dir={tmp_path}"],
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=_env(),
        )
        for _ in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
    run_dirs = sorted((tmp_path / "recsys-train").iterdir())
    assert len(run_dirs) == 2
    for run_dir in run_dirs:
        assert _status(run_dir)["status"] == "completed"
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3  # not interleaved


@pytest.mark.timeout(200)
def test_sweep_in_one_process_uses_hydra_sweep_dir(tmp_path):
    """(hydra.run.dir, honoured as it is: test_a_checkpoint_of_another_shape_or_model_is_named_before_dcp_loads)"""
    sweep = tmp_path / "my_sweep"
    proc = subprocess.run(
        [str(BIN / "recsys-train"), "-m", "thread_map=by_stream,per_task", *SMOKE, f"hydra.sweep.dir={sweep}"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]  # each job in its own directory, none left empty
    for job, thread_map in zip(jobs, ["by_stream", "per_task"]):
        assert _status(job)["status"] == "completed"
        assert f"name: {thread_map}" in (job / "config.yaml").read_text()
        assert len((job / "metrics.jsonl").read_text().splitlines()) == 3
    assert not (tmp_path / "runs").exists()  # nothing written elsewhere


# -- faults on 2 ranks --------------------------------------------------------------------------

FAULTS = [
    # (plan overrides, fault kind, the failed rank's status message fragment)
    (["pipeline=serial"], "sigkill", "stopped responding"),
    (["pipeline=hstu_prefetch"], "raise", "RuntimeError: injected fault on rank"),
    (["pipeline=hstu_prefetch", "thread_map=per_task"], "collective", "Default process group has not been initialized"),
]


def _torchrun(tmp: Path, *args: str, env: dict | None = None, timeout: float = 150) -> tuple:
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "--no-python",
            str(BIN / "recsys-train"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp,
        env=_env(**(env or {})),
    )
    return proc, time.monotonic() - start


def _assert_exit_codes(proc: subprocess.CompletedProcess, code: int) -> None:
    """torchrun's summary: the ranks exited `code`, except any that torchrun itself stopped
    (SIGTERM, -15) once the first had exited."""
    codes = [int(c) for c in re.findall(r"exitcode\s*: (-?\d+)", proc.stderr)]
    assert code in codes and set(codes) <= {code, -15}, proc.stderr[-3000:]


def _leftovers(marker: str) -> list[str]:
    """Processes still running whose command line mentions `marker` (our unique tmp dir)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline:
            found.append(cmdline)
    return found


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("plan, kind, fragment", FAULTS, ids=[f[1] for f in FAULTS])
def test_a_failed_rank_is_named_and_every_rank_exits(plan, kind, fragment, tmp_path):
    rank, step = random.randrange(2), random.randrange(3, 12)
    proc, seconds = _torchrun(
        tmp_path,
        *plan,
        FAULT_OVERRIDE,
        "trainer=smoke",
        "trainer.max_steps=40",
        "trainer.eval_every=0",
        f"trainer.output_dir={tmp_path}/r",
        env={FAULT_ENV: f"{kind}:{rank}:{step}"},
    )
    note = f"{kind} on rank {rank} at step {step}: "
    assert proc.returncode != 0, note + proc.stderr[-3000:]
    assert seconds < 90, note + f"took {seconds:.0f} s"
    (run_dir,) = (tmp_path / "r" / "recsys-train").iterdir()
    status = _status(run_dir)
    assert status["status"] == "failed" and status["failed_rank"] == rank, note + str(status)
    assert fragment in status["message"], note + str(status)
    log = (run_dir / "train.log").read_text()
    survivor = 1 - rank
    assert f"[rank {survivor}][ERROR] rank {rank} failed" in log, note + log[-3000:]
    assert "/recsys_pipe/" not in proc.stderr, note + "a rank printed a traceback"  # torchrun prints its own
    assert _leftovers(str(tmp_path)) == []


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["bad data file", "misspelled key"])
def test_bad_input_under_torchrun_exits_2_on_every_rank_printed_once(case, tmp_path):
    short_row = tmp_path / "ratings.dat"
    short_row.write_text("1::2::4::100\n1::3::5::101\n1::4::3\n")
    args, line = {
        "bad data file": ([*ML, f"data.path={short_row}"], f"error: data.path: {short_row}:3: expected 4 fields"),
        "misspelled key": (
            ["trainer.max_step=3"],
            "error: trainer.max_step: unknown key (did you mean trainer.max_steps?)",
        ),
    }[case]
    proc, _ = _torchrun(tmp_path, *args, f"trainer.output_dir={tmp_path}/r")
    _assert_exit_codes(proc, 2)
    assert proc.stderr.count(line) == 1, proc.stderr  # once, not once per rank
    assert "/recsys_pipe/" not in proc.stderr  # no rank printed a traceback
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_hung_rank_cannot_hang_the_job(tmp_path):
    """Rank 1 stops inside a step: rank 0's collective times out after trainer.peer_timeout_s, it
    records the failure, and rank 1's watchdog ends the hung process too."""
    proc, seconds = _torchrun(
        tmp_path,
        "pipeline=hstu_prefetch",
        FAULT_OVERRIDE,
        "trainer=smoke",
        "trainer.max_steps=40",
        "trainer.eval_every=0",
        "trainer.peer_timeout_s=5",
        f"trainer.output_dir={tmp_path}/r",
        env={FAULT_ENV: "hang:1:4"},
    )
    assert proc.returncode != 0
    assert seconds < 100, f"took {seconds:.0f} s"
    (run_dir,) = (tmp_path / "r" / "recsys-train").iterdir()
    status = _status(run_dir)
    assert status["status"] == "failed" and "Timed out" in status["message"], status
    assert "[rank 1][ERROR] rank 0 failed" in (run_dir / "train.log").read_text()
    assert _leftovers(str(tmp_path)) == []


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_undeclared_collective_is_a_plan_error_not_a_gloo_abort(tmp_path):
    """The plan's collective tasks are not declared nccl: true and every task has its own thread:
    without verification gloo aborts ("collective mismatch", SIGABRT); with it (on by default
    for the first iterations) every rank exits 2 naming a task's nccl field."""
    undeclared = [
        f"pipeline.tasks.{t}.nccl=false" for t in ("start_input_dist", "wait_input_dist", "forward", "backward")
    ]
    proc, _ = _torchrun(
        tmp_path,
        "pipeline=hstu_prefetch",
        "thread_map=per_task",
        *undeclared,
        *SMOKE,
        f"trainer.output_dir={tmp_path}/r",
    )
    _assert_exit_codes(proc, 2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: pipeline.tasks.")]
    assert errors and all(".nccl: task '" in e and "issues the collective c10d." in e for e in errors), errors
    assert "mismatch" not in proc.stderr and "SIGABRT" not in proc.stderr
    (run_dir,) = (tmp_path / "r" / "recsys-train").iterdir()
    assert _status(run_dir)["exit_code"] == 2


def test_ctrl_c_raises_until_a_failure_is_being_handled_then_is_recorded():
    """runtime.CtrlC: a Ctrl-C is Python's KeyboardInterrupt, but once a failure is being handled
    (a collective broke because a peer stopped on the same Ctrl-C) it is recorded instead, so
    the rank reports the interruption rather than a second exception inside its error handling."""
    from recsys_pipe.runtime import CtrlC

    before = signal.getsignal(signal.SIGINT)
    # raise_signal: delivered to this (the main) thread before it returns, whatever other threads
    # the process has, so the handler runs at the next bytecode, not after some sleep
    with CtrlC() as ctrl_c, pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
        time.sleep(5)  # interrupted well before
    assert ctrl_c.seen
    with CtrlC() as ctrl_c:
        assert ctrl_c.during_failure() is False
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.01)  # no KeyboardInterrupt
        assert ctrl_c.during_failure() is True
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sweep_under_torchrun_runs_every_job_without_hanging(tmp_path):
    proc, _ = _torchrun(tmp_path, "-m", "thread_map=by_stream,per_task", *SMOKE, f"trainer.output_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = (tmp_path / "recsys-train" / "multirun").iterdir()  # one sweep dir for both ranks
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    for job in jobs:
        status = _status(job)
        assert status["status"] == "completed" and status["world_size"] == 2
