"""The failure catalogue, continued: inputs that used to pass `recsys-train --check` (and so
`scripts/train.sh`) and were refused only after torchrun had started.

Each case is refused by `recsys-train --check` with exit 2 and one `error: <key>: ...` line, and
by the run itself the same way before any process group starts (the run and `--check` share
`Launch.prepare`). Then the smaller items: what a run says (or no longer says) around it.
"""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path

import pytest

from recsys_pipe.cli import train as train_cli


def _pairs(tmp: Path, users: int = 40, items: int = 30, name: str = "seq.txt") -> str:
    """A "user item" file: user u interacts with 3..12 consecutive items."""
    lines = [f"{u} {(u * 7 + k) % items + 100}" for u in range(1, users + 1) for k in range(3 + u % 10)]
    path = tmp / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _one_user_saw_everything(tmp: Path) -> str:
    lines = [f"5 {i}" for i in range(8)] + [f"{u} {i}" for u in range(6, 30) for i in range(u % 4, u % 4 + 3)]
    path = tmp / "all.txt"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _seq(tmp: Path) -> list[str]:
    return ["model=sasrec", "data=sequences", f"data.path={_pairs(tmp)}", "data.eval_negatives=10", "data.batch_size=4"]


# (id, overrides for tmp, config path of the error, message fragment)
CASES = [
    (
        "eval_dump without a retrieval source",
        lambda tmp: [f"trainer.eval_dump={tmp}/d.csv"],
        "trainer.eval_dump",
        "data source 'synthetic' has no retrieval evaluation to dump",
    ),
    (
        "eval_dump in a missing directory",
        lambda tmp: [*_seq(tmp), f"trainer.eval_dump={tmp}/nowhere/d.csv"],
        "trainer.eval_dump",
        "no such directory: ",
    ),
    (
        "eval_dump is a directory",
        lambda tmp: [*_seq(tmp), f"trainer.eval_dump={tmp}"],
        "trainer.eval_dump",
        "is a directory; trainer.eval_dump names the CSV file",
    ),
    (
        "eval_dump with evaluation off",
        lambda tmp: [*_seq(tmp), "trainer.eval_dump=d.csv", "trainer.eval_every=0"],
        "trainer.eval_dump",
        "trainer.eval_every=0 turns evaluation off",
    ),
    (
        "fused adam on the CPU",
        lambda tmp: [*_seq(tmp), "optimizer.sparse.name=adam"],
        "optimizer.sparse.name",
        "adam is not fused into torchrec tables on the CPU",
    ),
    (
        "semi_sync lookups both until",
        lambda tmp: ["pipeline=semi_sync", "pipeline.tasks.start_embedding_lookup.options.batches=until"],
        "pipeline.tasks.start_embedding_lookup.options",
        "batch 0 is looked up by start_embedding_lookup and start_embedding_lookup_synced",
    ),
    (
        "semi_sync lookup leaves batches out",
        lambda tmp: ["pipeline=semi_sync", "pipeline.tasks.start_embedding_lookup_synced.options.batches=after"],
        "pipeline.tasks.start_embedding_lookup.options",
        "batch 0 is looked up by no lookup task",
    ),
    (
        "a user who interacted with every item",
        lambda tmp: (
            ["model=sasrec", "data=sequences", f"data.path={_one_user_saw_everything(tmp)}"]
            + ["data.eval_negatives=3", "data.batch_size=2"]
        ),
        "data.path",
        "all.txt: user 5 interacted with all 8 items, so no negatives can be sampled",
    ),
    (
        "shared num_negatives beyond the catalogue",
        lambda tmp: [*_seq(tmp), "model.loss=sampled_softmax", "model.negatives=shared", "model.num_negatives=500"],
        "model.num_negatives",
        "500 shared negatives per batch, but the data has 30 items",
    ),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", ["--check", "run", "train.sh"])
@pytest.mark.parametrize("name, overrides, path, fragment", CASES, ids=[c[0] for c in CASES])
def test_refused_by_check_and_by_the_run_before_anything_starts(
    name, overrides, path, fragment, check, tmp_path, capsys, monkeypatch, no_process_group
):
    """`run`: one rank, as `recsys-train` alone; `train.sh`: the check scripts/train.sh makes
    before torchrun (`--check` as the last of 2 ranks)."""
    if check == "train.sh":
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "1")
    argv = [*overrides(tmp_path), "trainer.device=cpu", f"trainer.output_dir={tmp_path}/runs"]
    code = train_cli.run(argv if check == "run" else ["--check", *argv])
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: "), err
    assert fragment in lines[0], err
    assert "Traceback" not in err and "config OK" not in captured.out
    assert not (tmp_path / "runs" / "recsys-train").exists()


def test_check_says_so_on_success(tmp_path, capsys, no_process_group):
    code = train_cli.run(["--check", "-m", "trainer.max_steps=3,4", f"trainer.output_dir={tmp_path}/runs"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[-1] == "recsys-train: config OK: 2 job(s) checked, nothing was started"
    assert len(lines) == 3 and all(line.startswith("estimated peak memory: largest rank 0, ") for line in lines[:2])


def test_a_missing_file_is_named_once(tmp_path, capsys, no_process_group):
    code = train_cli.run(["--check", "model=sasrec", "data=sequences", "data.path=Video.txt"])
    err = capsys.readouterr().err
    assert code == 2
    assert "error: data.path: no such file: Video.txt\n" in err and "got 'Video.txt'" not in err


# -- eval_dump: a relative path lands in the run directory, named in the log ---------------------


@pytest.mark.timeout(300)
def test_a_relative_eval_dump_is_written_in_the_run_directory_and_logged(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "the_run"
    argv = [*_seq(tmp_path), "trainer.eval_dump=dumps/ranks.csv", "trainer.max_steps=2", "trainer.eval_every=1"]
    code = train_cli.run([*argv, "trainer.device=cpu", "trainer.progress_bar=false", f"hydra.run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 0, err
    dump = run_dir / "dumps" / "ranks.csv"
    assert dump.read_text().startswith("user,item,rank_sampled,rank_full\n")
    assert not (tmp_path / "dumps").exists()
    said = [line.split("[INFO] ", 1)[-1] for line in err.splitlines() if "trainer.eval_dump" in line]
    assert said == [f"trainer.eval_dump: the best evaluation's test ranks go to {dump}"], err


# -- a plan that has no effect on the model --------------------------------------------------------


def test_semi_sync_on_plain_torch_tables_warns_once():
    from recsys_pipe.testing import load_run
    from recsys_pipe.train.plan import pipelining_without_effect, training_plan

    run = load_run("model=dlrm_torch", "pipeline=semi_sync")
    warning = pipelining_without_effect(training_plan(run), run)
    assert warning is not None and "\n" not in warning
    assert "model 'dlrm_torch' has no torchrec tables" in warning and "as pipeline=serial would" in warning
    for plan in ("serial", "semi_sync"):  # no warning where the plan does what it says
        for model in ("dlrm_torch", "dlrm"):
            if (plan, model) != ("semi_sync", "dlrm_torch"):
                run = load_run(f"model={model}", f"pipeline={plan}")
                assert pipelining_without_effect(training_plan(run), run) is None, (plan, model)


# -- recsys-plan tune=true keeps the one-key start_batch override ---------------------------------


@pytest.mark.timeout(120)
def test_a_tuned_semi_sync_plan_keeps_the_start_batch_interpolation(tmp_path, capsys):
    import json

    from omegaconf import OmegaConf

    from recsys_pipe.cli import plan as plan_cli
    from recsys_pipe.testing import load_run
    from recsys_pipe.train import training_plan

    run = load_run("pipeline=semi_sync")
    tasks = {t.name: {"cpu_s": 0.001, "device_s": 0.0} for t in training_plan(run).order}
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"tasks": tasks}))
    code = plan_cli.run(
        ["pipeline=semi_sync", f"costs={costs}", "tune=true", "tune_time_limit_s=2", f"hydra.run.dir={tmp_path}"]
    )
    assert code == 0, capsys.readouterr().err
    written = OmegaConf.load(tmp_path / "pipeline" / "semi_sync_tuned.yaml")
    synced = OmegaConf.to_container(written.tasks.start_embedding_lookup_synced.options, resolve=False)
    assert synced["start_batch"] == "${pipeline.tasks.start_embedding_lookup.options.start_batch}"
    search = [f"hydra.searchpath=[file://{tmp_path}]", "pipeline=semi_sync_tuned", "thread_map=plan"]
    tuned = training_plan(load_run(*search, "pipeline.tasks.start_embedding_lookup.options.start_batch=3"))
    options = {t.name: t.options for t in tuned.order if t.name.startswith("start_embedding_lookup")}
    assert options["start_embedding_lookup"].start_batch == options["start_embedding_lookup_synced"].start_batch == 3


# -- what a run leaves behind ------------------------------------------------------------------


def test_an_interrupted_run_gives_ctrl_c_back():
    import os

    from recsys_pipe.cli.launch import _interrupted

    class Session:
        def interrupted(self, step: int, checkpoint: str | None) -> int:
            # a second Ctrl-C waits for the clean-up: only recorded (the command exits 130)
            os.kill(os.getpid(), signal.SIGINT)
            assert checkpoint is None
            return 130

    before = signal.getsignal(signal.SIGINT)
    assert _interrupted(Session(), None) == 130
    assert signal.getsignal(signal.SIGINT) is before


def test_rank_1_shows_no_library_warnings_and_rank_0_no_deprecations(recwarn, caplog):
    """Rank 1 silences torch's own loggers too (`[rank1]:W... torch/fx/...` came through them);
    rank 0 shows a library's FutureWarning once but no DeprecationWarning (fbgemm's import
    printed ~40 colour-coded lines of them), and no warning that only describes torchrec's or
    torch's internals (every run printed `broadcast_buffers`, `is_fx_tracing` and on resume 3x
    ShardedTensor); debug=true shows everything."""
    import logging

    from recsys_pipe.cli.console import show_library_warnings

    INTERNAL = [  # what torchrec and torch print, verbatim in its start
        ("torchrec DMP", "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead."),
        ("DCP on a resume", "Please use DTensor instead and we are deprecating ShardedTensor."),
        ("fbgemm under torch.export", "_check_is_size will be removed in a future PyTorch release"),
    ]

    def emitted() -> tuple[int, int, int]:
        before = len(recwarn)
        warnings.warn("a deprecation", DeprecationWarning, stacklevel=1)
        deprecations = len(recwarn) - before
        warnings.warn("a future change", FutureWarning, stacklevel=1)
        warnings.warn("a future change", FutureWarning, stacklevel=1)
        futures = len(recwarn) - before - deprecations
        before = len(recwarn)
        for _, message in INTERNAL:
            warnings.warn(message, FutureWarning, stacklevel=1)
        internal = len(recwarn) - before
        caplog.clear()
        logging.getLogger("torch.fx._symbolic_trace").warning("is_fx_tracing will return true for both ...")
        return deprecations, futures, internal + len(caplog.records)

    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        try:
            show_library_warnings(1, debug=False)
            assert emitted() == (0, 0, 0)
            show_library_warnings(0, debug=False)
            assert emitted() == (0, 1, 0)
            show_library_warnings(1, debug=True)
            shown = emitted()
            assert shown[0] == 1 and shown[2] == len(INTERNAL) + 1
        finally:
            show_library_warnings(0, debug=True)


@pytest.mark.timeout(120)
def test_recsys_profile_on_too_little_data_names_the_key(tmp_path, capsys, no_process_group):
    from recsys_pipe.cli import profile as profile_cli

    argv = [*_seq(tmp_path), "data.batch_size=8", "trainer.device=cpu", f"trainer.output_dir={tmp_path}/runs"]
    code = profile_cli.run(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: profile.iters: the data gives "), err
    assert "each profiling pass needs 23" in lines[0] and "Traceback" not in err


# -- sweeps: a summary at the end, and no train.log left open -------------------------------------

_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.mark.timeout(300)
def test_a_sweep_ends_with_a_summary_and_closes_each_train_log(tmp_path):
    """In a subprocess with ResourceWarning an error (shown through `-W error`): an unclosed
    train.log of the first job would be reported when the second job replaces its handler."""
    import subprocess
    import sys

    sweep = tmp_path / "sweep"
    smoke = ["trainer=smoke", "trainer.eval_every=0", "trainer.tensorboard=false"]
    code = (
        "import gc, sys, warnings; warnings.simplefilter('error', ResourceWarning); "
        "from recsys_pipe.cli import train; code = train.run(sys.argv[1:]); gc.collect(); sys.exit(code)"
    )
    proc = subprocess.run(
        [sys.executable, "-X", "dev", "-c", code, "-m", "trainer.max_steps=1,2", *smoke, f"hydra.sweep.dir={sweep}"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
        env={  # not this process's rendezvous (an in-process run of an earlier test may have set it)
            **{k: v for k, v in os.environ.items() if k not in _RENDEZVOUS},
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ResourceWarning" not in proc.stderr and "unclosed file" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert "recsys-train: sweep of 2 job(s): 2 completed, 0 did not" in lines, proc.stderr[-3000:]
    start = lines.index("recsys-train: sweep of 2 job(s): 2 completed, 0 did not")
    assert lines[start + 1] == f"  job 0 [trainer.max_steps=1]: completed, exit 0 ({sweep}/0)"
    assert lines[start + 2] == f"  job 1 [trainer.max_steps=2]: completed, exit 0 ({sweep}/1)"


def test_help_gives_every_description_whole(capsys):
    from recsys_pipe.cli.keys import describe_keys
    from recsys_pipe.config import to_container
    from recsys_pipe.testing import compose
    from recsys_pipe.train.config import RunConfig

    assert train_cli.run(["--help"]) == 0
    listing = capsys.readouterr().out.split("== Keys ==", 1)[1]
    for path, value, description in describe_keys(RunConfig, to_container(compose(config_name="train"))):
        (line,) = [x for x in listing.splitlines() if x.startswith(f"  {path}=" if value else f"  {path}:")]
        assert line.endswith(description), line


def test_check_refuses_a_used_run_directory_on_any_rank(tmp_path, capsys, monkeypatch):
    """`--check` (what scripts/train.sh runs before torchrun) checks `hydra.run.dir` as the run
    does: a directory that already holds a run is refused before torchrun starts."""
    used = tmp_path / "used"
    used.mkdir()
    (used / "status.json").write_text("{}")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert train_cli.run(["--check", f"hydra.run.dir={used}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"error: hydra.run.dir: {used} already holds a run ({used}/status.json exists); " + (
        "choose a new directory or remove it"
    )
    assert train_cli.run(["--check", f"hydra.run.dir={tmp_path / 'new'}"]) == 0
    assert not (tmp_path / "new").exists()
