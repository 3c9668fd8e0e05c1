"""`recsys-train`: validate the config, start the process group, train, tear down cleanly.

    recsys-train pipeline=serial trainer.max_steps=20
    torchrun --nproc_per_node 2 --no-python recsys-train pipeline=hstu_prefetch
    recsys-train trainer.checkpoint.interval=100 trainer.resume_from=latest
    recsys-train -m thread_map=by_stream,per_task      # a sweep: one run directory per job

It starts the way every command that trains does (`recsys_pipe.cli.launch`): before any process
group starts, every rank checks everything it can (`Launch.prepare`), and a problem there
exits 2 with `error: <path>: <message>`; a sweep checks every job that way before the first
one starts. After start-up, errors are logged to `train.log` by the rank that saw them (with
the traceback in the file), the first failure of the job is recorded in the run's
`status.json` naming the rank that failed, and every rank exits: 1 (failure), 2 (bad input
found late, e.g. a checkpoint that does not fit the model), 75 (SIGTERM: checkpoint saved),
130 (Ctrl-C).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from recsys_pipe import _ctrl_c
from recsys_pipe.cli.app import HydraApp
from recsys_pipe.cli.console import show_library_warnings
from recsys_pipe.cli.launch import Launch, Outcome, run_job
from recsys_pipe.train.preflight import check_plan, check_run

if TYPE_CHECKING:
    from recsys_pipe.train import Trainer

__all__ = ["check_config", "main", "run", "train_task"]

log = logging.getLogger("recsys_pipe")
PROG = "recsys-train"


def train_task(cfg: DictConfig) -> None:
    """One job: prepare, start, build, restore and fit, close (`run_job`)."""
    run_job(cfg, PROG, _fit)


def _fit(launch: Launch, trainer: Trainer, resume: Path | None) -> Outcome:
    """Restore (if resuming) and fit; the outcome for status.json."""
    from recsys_pipe.train.progress import PREEMPTED

    if resume is not None:
        trainer.restore(str(resume))
        # one TensorBoard run across resumes: the events go on in the resumed run's directory
        trainer.reporter.metrics.continue_tensorboard(resume.parent.parent, trainer.step)
    elif launch.run.trainer.resume_from == "latest" and trainer.info.is_main:
        where = launch.run.trainer.output_dir
        log.info("trainer.resume_from=latest: no checkpoint under %s, starting from step 0", where)
    summary = trainer.fit()
    if trainer.info.is_main:
        log.info("%s", summary.describe())
    fields = {
        "stop_reason": summary.stop_reason,
        "step": summary.end_step,
        "checkpoint": summary.checkpoint,
        "eval": summary.evals[-1] if summary.evals else None,
    }
    if summary.skipped is not None:  # data.on_bad_row=skip: the bad rows left out, over all ranks
        fields["skipped_rows"] = summary.skipped
    # a signal during the last checkpoint or evaluation stops nothing more, but is not ignored:
    # the run ends as a stopped one (130 for Ctrl-C, 75 for SIGTERM), its checkpoint recorded
    stopped = summary.stop_reason == PREEMPTED or trainer.stop.requested.is_set()
    return Outcome(stopped, fields)


def check_config(cfg: DictConfig) -> None:
    """What `train_task` refuses before anything starts, but its run directory (`check_run`):
    the config, plan, device, distribution and data of every job of a sweep, checked before
    the first one trains."""
    check_run(cfg)


def _check(cfg: DictConfig) -> None:
    """`--check`: every check a job makes before its process group (`Launch.prepare`), then the
    estimated peak memory of this job's ranks (`WORLD_SIZE`, `LOCAL_WORLD_SIZE`): one line, and
    a warning where the largest rank does not fit."""
    line, warning = Launch.prepare(cfg).checked.memory_check()
    print(line)
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr)


_app = HydraApp(
    train_task,
    config_name="train",
    prog=PROG,
    schema="recsys_pipe.train.config:RunConfig",
    # a single job's config before Hydra runs it (the job repeats all of `check_run` first
    # thing, so reading its data twice is left to sweeps)
    validate=check_plan,
    check=_check,  # `--check`: every check before a process group, for this RANK/WORLD_SIZE, and memory
    sweep_check=check_config,
)


def run(argv: Sequence[str] | None = None) -> int:
    """Run `recsys-train` in-process with `argv`; returns the exit code."""
    return _app.run(argv)


def main() -> None:
    """Console-script entry point. Exits with os._exit after flushing: gloo's worker threads
    can abort an orderly interpreter shutdown (seen ~1 run in 10)."""
    show_library_warnings(int(os.environ.get("RANK", 0)), debug="debug=true" in sys.argv)  # before any import warns
    code = _app.run()
    _ctrl_c.record()  # the run is over (its code decided): a Ctrl-C from now on makes it 130, never ignored
    _ctrl_c.pause_point("exit")
    if code == 0:
        from recsys_pipe.runtime.distributed import teardown

        teardown()  # after a sweep, whose jobs shared the process group
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_ctrl_c.settle(code))


if __name__ == "__main__":
    main()
