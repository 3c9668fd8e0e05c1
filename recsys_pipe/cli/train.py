"""`recsys-train`: validate the config, start the process group, train, tear down cleanly.

    recsys-train pipeline=serial trainer.max_steps=20
    torchrun --nproc_per_node 2 --no-python recsys-train pipeline=hstu_prefetch
    recsys-train trainer.checkpoint.interval=100 trainer.resume_from=latest
    recsys-train -m thread_map=by_stream,per_task      # a sweep: one run directory per job

Before any process group starts, every rank checks everything it can (`Launch.prepare`): the
config, the plan (task functions imported), the device, `resume_from`, its share of the data and
the output directory. A problem there exits 2 with `error: <path>: <message>`. After start-up,
errors are logged to `train.log` by the rank that saw them (with the traceback in the file), the
first failure of the job is recorded in the run's `status.json` naming the rank that failed, and
every rank exits: 1 (failure), 2 (bad input found late, e.g. a checkpoint that does not fit the
model), 75 (SIGTERM: checkpoint saved), 130 (Ctrl-C).
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from recsys_pipe.cli.app import hydra_app
from recsys_pipe.cli.console import show_library_warnings
from recsys_pipe.cli.launch import Launch
from recsys_pipe.cli.reporting import report_config_error
from recsys_pipe.config import ConfigError
from recsys_pipe.runtime.failures import EXIT_CONFIG_ERROR, config_error_in, is_communication_error
from recsys_pipe.runtime.preemption import CtrlC
from recsys_pipe.runtime.session import RunSession

__all__ = ["main", "run", "train_task"]

log = logging.getLogger("recsys_pipe")
PROG = "recsys-train"


def train_task(cfg: DictConfig) -> None:
    """One job: parse and validate, preflight, init, build and fit, close."""
    show_library_warnings(int(os.environ.get("RANK", 0)), cfg.get("debug", False) is True)
    launch = Launch.prepare(cfg)  # no process group yet: a bad input exits 2 here
    try:
        session, resume = launch.start(PROG)
    except ConfigError as exc:  # e.g. the named run directory was taken meanwhile
        report_config_error(exc, PROG, started=True)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    previous = signal.getsignal(signal.SIGINT)
    try:
        code = fit(launch, session, resume)  # returns with Ctrl-C ignored: the outcome is recorded,
        code = session.close(code, keep_group=launch.requested.sweep)  # the group is left in order
    finally:  # the process goes on (a sweep's next job): Ctrl-C works again
        signal.signal(signal.SIGINT, previous)
    if code:
        raise SystemExit(code)


def fit(launch: Launch, session: RunSession, resume: Path | None) -> int:
    """Build, restore, fit; returns the exit code and records the outcome in status.json."""
    from recsys_pipe.train import Trainer, build_parts
    from recsys_pipe.train.trainer import PREEMPTED

    run, info = _with_run_paths(launch.run, session.run_dir), session.info
    if info.is_main and run.trainer.eval_dump is not None:
        log.info("trainer.eval_dump: the best evaluation's test ranks go to %s", run.trainer.eval_dump)
    trainer = None
    ctrl_c = CtrlC()
    # what SIGINT does once the handlers below are gone again: nothing (the run's outcome is then
    # being recorded and the process group left; the caller restores Ctrl-C)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        # a Ctrl-C asks every rank to stop after a step and checkpoint (130), as SIGTERM does (75),
        # also while the parts are built: the loop stops after its first step; a second Ctrl-C
        # stops at once, saving nothing (KeyboardInterrupt, `ctrl_c`)
        with ctrl_c, session.stop.interrupts():
            # the build phase: every part the loop runs on, from the config, once
            parts = build_parts(run, launch.plan, info, session.run_dir, data=launch.data)
            trainer = Trainer(
                run, launch.plan, info, session.run_dir, stop=session.stop, health=session.health, parts=parts
            )
            if resume is not None:
                trainer.restore(str(resume))
                # one TensorBoard run across resumes: the events go on in the resumed run's directory
                trainer.metrics.continue_tensorboard(resume.parent.parent, trainer.step)
            elif run.trainer.resume_from == "latest" and info.is_main:
                log.info(
                    "trainer.resume_from=latest: no checkpoint under %s, starting from step 0", run.trainer.output_dir
                )
            summary = trainer.fit()
    except KeyboardInterrupt:
        return _interrupted(session, trainer)
    except BaseException as exc:  # every failure is recorded, then the rank exits
        if ctrl_c.during_failure() and is_communication_error(exc):  # a peer that stopped on the same Ctrl-C
            return _interrupted(session, trainer)
        bad_input = config_error_in(exc)  # found late: a checkpoint that does not fit, an undeclared collective
        if bad_input is not None:
            report_config_error(bad_input, PROG, started=True)
        code = session.failed(exc, _user_code_owners(run))
        if trainer is not None:
            trainer.metrics.close()
        return code
    if info.is_main:
        log.info("%s", summary.describe())
    trainer.close()
    last_eval = summary.evals[-1] if summary.evals else None
    return session.completed(
        summary.stop_reason == PREEMPTED,
        stop_reason=summary.stop_reason,
        step=summary.end_step,
        checkpoint=summary.checkpoint,
        eval=last_eval,
    )


def _user_code_owners(run: Any) -> dict[str, str]:
    """Source file -> `<section>.builder (<import path>)` of the run's components, so that a failure
    in the user's model or data code names the key that chose it (`user_code_report`)."""
    owners = {}
    for section in ("model", "data", "optimizer"):
        component = getattr(run, section)
        try:
            source = inspect.getsourcefile(component.builder_fn())
        except (TypeError, ImportError, ValueError):  # a builder without a Python source file
            continue
        if source is not None:
            owners[str(Path(source).resolve())] = f"{section}.builder ({component.builder})"
    return owners


def _with_run_paths(run: Any, run_dir: str) -> Any:
    """`run` with a relative `trainer.eval_dump` made a path inside the run directory."""
    from recsys_pipe.train.retrieval_eval import eval_dump_path

    trainer = run.trainer.model_copy(update={"eval_dump": eval_dump_path(run.trainer.eval_dump, str(run_dir))})
    return run.model_copy(update={"trainer": trainer})


def _interrupted(session: RunSession, trainer: Any) -> int:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun forwards a second SIGINT: finish cleaning up
    try:
        code = session.interrupted(trainer.step if trainer is not None else 0)
        if trainer is not None:
            trainer.close()
    finally:  # the process goes on (a caller of `run`, the next job): Ctrl-C works again
        signal.signal(signal.SIGINT, previous)
    return code


def check_config(cfg: DictConfig) -> None:
    """What `train_task` refuses before anything starts: the run config and the compiled plan
    (checked for every job of a sweep before the first one trains)."""
    from recsys_pipe.train.config import load_run_config
    from recsys_pipe.train.plan import training_plan

    training_plan(load_run_config(cfg))


_app = hydra_app(
    train_task,
    config_name="train",
    prog=PROG,
    schema="recsys_pipe.train.config:RunConfig",
    validate=check_config,
    check=Launch.prepare,  # `--check`: every check before a process group, for this RANK/WORLD_SIZE
)


def run(argv: Sequence[str] | None = None) -> int:
    """Run `recsys-train` in-process with `argv`; returns the exit code."""
    return _app.run(argv)


def main() -> None:
    """Console-script entry point. Exits with os._exit after flushing: gloo's worker threads
    can abort an orderly interpreter shutdown (seen ~1 run in 10)."""
    show_library_warnings(int(os.environ.get("RANK", 0)), debug="debug=true" in sys.argv)  # before any import warns
    code = _app.run()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run is over (its code decided): only the exit is left
    if code == 0:
        from recsys_pipe.runtime.distributed import teardown

        teardown()  # after a sweep, whose jobs shared the process group
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
