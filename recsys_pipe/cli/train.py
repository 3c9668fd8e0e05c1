"""`recsys-train`: validate the config, start the process group, train, tear down cleanly.

    recsys-train pipeline=serial trainer.max_steps=20
    torchrun --nproc_per_node 2 --no-python recsys-train pipeline=hstu_prefetch
    recsys-train trainer.checkpoint.interval=100 trainer.resume_from=latest
    recsys-train -m thread_map=by_stream,per_task      # a sweep: one run directory per job

Before any process group starts, every rank checks everything it can: the config, the plan
(task functions imported), the device, `resume_from`, its share of the data (MovieLens files are
parsed) and the output directory. A problem there exits 2 with `error: <path>: <message>`.
After start-up, errors are logged to `train.log` by the rank that saw them (with the traceback
in the file), the first failure of the job is recorded in the run's `status.json` naming the
rank that failed, and every rank exits: 1 (failure), 2 (bad input found late, e.g. a
checkpoint that does not fit the model), 75 (SIGTERM: checkpoint saved), 130 (Ctrl-C).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from recsys_pipe.cli._hydra import (
    EXIT_CONFIG_ERROR,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    hydra_app,
    report_config_error,
)
from recsys_pipe.cli.console import show_library_warnings
from recsys_pipe.config import ConfigError
from recsys_pipe.train.config import RunConfig, load_run_config
from recsys_pipe.train.plan import training_plan

__all__ = ["train_task", "run", "main"]

log = logging.getLogger("recsys_pipe")


class _OneLine(logging.Formatter):
    """Console format: the message without the traceback (which goes to train.log)."""

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text
        record.exc_info = record.exc_text = None
        try:
            return super().format(record)
        finally:
            record.exc_info, record.exc_text = saved


def _setup_logging(rank: int, run_dir: str, debug: bool) -> None:
    """Rank 0: INFO to the console and train.log; other ranks: warnings and errors to both (so a
    failure is in train.log whichever rank saw it). Tracebacks only in train.log, unless debug."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    pattern = f"[%(asctime)s][rank {rank}][%(levelname)s] %(message)s"
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(pattern, "%H:%M:%S") if debug else _OneLine(pattern, "%H:%M:%S"))
    root.addHandler(console)
    file = logging.FileHandler(os.path.join(run_dir, "train.log"))  # appends: one line per write
    file.setFormatter(logging.Formatter(pattern, "%H:%M:%S"))
    root.addHandler(file)
    root.setLevel(logging.WARNING)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def _requested_run_dir() -> tuple[str | None, str, bool]:
    """(directory Hydra was told to use, its config key, whether this is a sweep job). A plain
    run uses no Hydra directory unless `hydra.run.dir=...` was given."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None, "", False
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        return os.path.abspath(hc.runtime.output_dir), "hydra.sweep.dir", True
    if any(o.startswith("hydra.run.dir=") for o in hc.overrides.hydra):
        return os.path.abspath(hc.runtime.output_dir), "hydra.run.dir", False
    return None, "", False


def _preflight(run: RunConfig, requested: str | None, key: str) -> Any:
    """Every check that needs no process group; returns this rank's data (`RankData`)."""
    from recsys_pipe.cli.preflight import run_device
    from recsys_pipe.data import RankData
    from recsys_pipe.train.checkpoint import resolve_resume
    from recsys_pipe.train.dense_ddp import check_dense_ddp
    from recsys_pipe.train.rundir import check_output_dir, check_unused

    device = run_device(run.trainer)
    check_dense_ddp(run, device.type)
    resolve_resume(run.trainer.resume_from, run.trainer.output_dir, run.model.name)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    data = RankData(run.data, rank, world_size, eval_batches=run.trainer.eval_batches)
    if requested is None:
        check_output_dir(run.trainer.output_dir)
    elif key == "hydra.run.dir":  # a sweep job's directory is claimed (atomically) by rank 0 later:
        check_unused(requested, key)  # checking it here would race with a faster rank 0
    return data


def train_task(cfg: DictConfig) -> None:
    run = load_run_config(cfg)
    show_library_warnings(int(os.environ.get("RANK", 0)), run.debug)
    plan = training_plan(run)  # compiled once, task functions imported, before any group starts
    requested, key, sweep = _requested_run_dir()
    data = _preflight(run, requested, key)

    import torch.distributed as dist

    from recsys_pipe.train import PeerHealth, RunStatus, StopRequest, init_distributed, shared_run_dir, teardown
    from recsys_pipe.train.checkpoint import resolve_resume

    info = init_distributed(run.trainer.device, run.trainer.backend, timeout_s=run.trainer.peer_timeout_s)
    try:
        run_dir = shared_run_dir(run.trainer.output_dir, "recsys-train", requested, key)
        # rank 0 picks the checkpoint: `latest` must mean the same directory on every rank
        resume = [resolve_resume(run.trainer.resume_from, run.trainer.output_dir) if info.is_main else None]
        dist.broadcast_object_list(resume, src=0)
    except ConfigError as exc:  # e.g. the named run directory was taken meanwhile
        report_config_error(exc, "recsys-train", started=True)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    _setup_logging(info.rank, run_dir, run.debug)
    status = RunStatus(
        run_dir,
        world_size=info.world_size,
        plan=run.pipeline.name,
        resumed_from=str(resume[0]) if resume[0] is not None else None,
    )
    if info.is_main:
        status.write("running", pid=os.getpid())
        container = OmegaConf.to_container(cfg, resolve=True)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml({k: v for k, v in container.items() if k != "hydra"}))
        log.info(
            "run dir %s | plan %s | %d rank(s) on %s (%s)",
            run_dir,
            run.pipeline.name,
            info.world_size,
            info.device,
            info.backend,
        )
    health = None
    if info.world_size > 1:
        health = PeerHealth(
            PeerHealth.connect(run.trainer.peer_timeout_s),
            run_dir,
            info.rank,
            info.world_size,
            run.trainer.peer_timeout_s,
            on_fatal=lambda failure: _record(health, status, failure, EXIT_FAILURE),
            exit_code=EXIT_FAILURE,
        ).start()
    with StopRequest(info.control_group, run.trainer.preemption_check_s) as stop:
        code = _train(run, plan, info, run_dir, data, resume[0], stop, health, status)
    if code not in (0, EXIT_PREEMPTED):
        raise SystemExit(code)
    if health is not None:
        health.mark_done()
        health.stop()
    try:
        if sweep:  # the next job of the sweep reuses the process group; main() tears it down
            dist.barrier()
        else:
            teardown()
    except Exception as exc:  # a peer failed after this rank had finished its part
        log.error("a peer failed while rank %d was finishing: %s", info.rank, _one_line(exc))
        raise SystemExit(EXIT_FAILURE) from None
    if code:
        raise SystemExit(code)


def _train(run, plan, info, run_dir, data, resume, stop, health, status) -> int:
    """Build, restore, fit; returns the exit code and records the outcome in status.json."""
    from recsys_pipe.train import PeerFailure, Trainer
    from recsys_pipe.train.trainer import PREEMPTED

    trainer = None
    try:
        trainer = Trainer(run, plan, info, run_dir, data=data, stop=stop, health=health)
        if resume is not None:
            trainer.restore(str(resume))
        elif run.trainer.resume_from == "latest" and info.is_main:
            log.info("trainer.resume_from=latest: no checkpoint under %s, starting from step 0", run.trainer.output_dir)
        summary = trainer.fit()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun forwards a second SIGINT: finish cleaning up
        step = trainer.step if trainer is not None else 0
        log.warning("interrupted (Ctrl-C): stopping after step %d, the last completed one; nothing saved", step)
        if info.is_main:
            status.write("interrupted", exit_code=EXIT_INTERRUPTED, step=step)
        if trainer is not None:
            trainer.close()
        return EXIT_INTERRUPTED
    except BaseException as exc:  # every failure is recorded, then the rank exits
        bad_input = _config_error(exc)  # found late: a checkpoint that does not fit, an undeclared collective
        code = EXIT_CONFIG_ERROR if bad_input is not None else EXIT_FAILURE
        failure = PeerFailure(info.rank, _one_line(bad_input or exc))
        if bad_input is not None:
            report_config_error(bad_input, "recsys-train", started=True)
        if health is not None and _is_communication_error(exc):  # maybe a symptom of a peer's failure
            failure = health.diagnose() or failure
        first = _record(health, status, failure, code)
        if first.rank == info.rank:
            log.error("training failed on rank %d: %s", info.rank, first.message, exc_info=exc)
        else:
            log.error(
                "rank %d failed first: %s (seen here as %s)", first.rank, first.message, _one_line(exc), exc_info=exc
            )
        if trainer is not None:
            trainer.metrics.close()
        return code
    if info.is_main:
        last_eval = summary.evals[-1] if summary.evals else None
        log.info(
            "trained %d steps (%d -> %d), %d samples, %.1f samples/s; loss %.4f -> %.4f%s",
            summary.steps,
            summary.start_step,
            summary.end_step,
            summary.samples,
            summary.samples_per_s,
            summary.first_loss or float("nan"),
            summary.last_loss or float("nan"),
            f"; eval auc {summary.evals[0]['auc']:.4f} -> {last_eval['auc']:.4f}" if last_eval else "",
        )
    preempted = summary.stop_reason == PREEMPTED
    trainer.close()
    if info.is_main:
        status.write(
            "preempted" if preempted else "completed",
            exit_code=EXIT_PREEMPTED if preempted else 0,
            stop_reason=summary.stop_reason,
            step=summary.end_step,
            checkpoint=summary.checkpoint,
            eval=last_eval,
        )
        if preempted:
            log.warning("exiting with code %d (preempted, resumable from %s)", EXIT_PREEMPTED, summary.checkpoint)
    return EXIT_PREEMPTED if preempted else 0


def _record(health: Any, status: Any, failure: Any, code: int) -> Any:
    """Report `failure` to the job; the rank whose report is the first writes status.json."""
    first, mine = health.report(failure) if health is not None else (failure, True)
    if mine:
        status.write("failed", exit_code=code, failed_rank=first.rank, message=first.message)
    return first


def _config_error(exc: BaseException) -> ConfigError | None:
    """The ConfigError behind `exc` (itself, or what made a task fail), if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConfigError):
            return seen
        seen = seen.__cause__
    return None


def _one_line(exc: BaseException) -> str:
    """`TaskFailedError: task 'x' failed on batch 4 ...: RuntimeError: <first line of the cause>`."""
    from recsys_pipe.engine import TaskFailedError

    if isinstance(exc, ConfigError):
        return "; ".join(str(p) for p in exc.problems)
    text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    cause = exc.__cause__ if isinstance(exc, TaskFailedError) else None
    if cause is not None:
        text += f": {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    return text


#: fragments of the errors a collective raises when a peer is gone or stuck
_COMM_ERRORS = ("gloo", "Connection closed", "Connection reset", "NCCL", "timed out", "Timed out")


def _is_communication_error(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) came from a collective, as a dead peer's would."""
    import torch.distributed as dist

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, dist.DistError) or any(f in str(seen) for f in _COMM_ERRORS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def check_config(cfg: DictConfig) -> None:
    """What `train_task` refuses before anything starts: the run config and the compiled plan
    (checked for every job of a sweep before the first one trains)."""
    training_plan(load_run_config(cfg))


def check_run(cfg: DictConfig) -> None:
    """`recsys-train --check`: every check made before a process group starts (config, plan,
    device, checkpoint, this rank's data by RANK/WORLD_SIZE, output dir); nothing is started."""
    run = load_run_config(cfg)
    training_plan(run)
    _preflight(run, None, "")


_app = hydra_app(
    train_task,
    config_name="train",
    prog="recsys-train",
    schema="recsys_pipe.train.config:RunConfig",
    validate=check_config,
    check=check_run,
)


def run(argv: Sequence[str] | None = None) -> int:
    """Run `recsys-train` in-process with `argv`; returns the exit code."""
    return _app.run(argv)


def main() -> None:
    """Console-script entry point. Exits with os._exit after flushing: gloo's worker threads
    can abort an orderly interpreter shutdown (seen ~1 run in 10)."""
    code = _app.run()
    if code == 0:
        from recsys_pipe.train.distributed import teardown

        teardown()  # after a sweep, whose jobs shared the process group
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
