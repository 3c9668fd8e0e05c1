"""The one start-up path of every command that trains a model (`recsys-train`,
`recsys-profile`) and of the checks before a sweep (`Launch.prepare`).

Before any process group starts, each rank runs train's pre-flight (`check_run`: the config,
the plan with its task code imported, the device, `resume_from`, the model's distribution over
the ranks, its share of the data and the model against it) and checks the output directory
(`Launch.prepare`). A problem there exits 2 with `error: <path>: <message>`. Then `run_job`
starts the rank's `RunSession` (process group, run directory with `config.yaml` and
`status.json`, logging, peer health, the SIGTERM agreement), has train build the `Trainer`
(`CheckedRun.build`) and runs the command's work under one supervision: Ctrl-C, failures (the
first one recorded in `status.json`), bad input found late and preemption end every command the
same way. This module keeps the run directory, the session and the supervision; what a run is
made of is train's.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from recsys_pipe import _ctrl_c
from recsys_pipe.config import CompiledPlan, ConfigError
from recsys_pipe.runtime.failures import EXIT_CONFIG_ERROR, config_error_in, is_communication_error
from recsys_pipe.runtime.session import RequestedDir, RunSession
from recsys_pipe.train.config import RunConfig
from recsys_pipe.train.preflight import CheckedRun, CommandCheck, check_run

if TYPE_CHECKING:
    from recsys_pipe.train import Trainer

__all__ = ["Launch", "Outcome", "requested_run_dir", "run_job"]

log = logging.getLogger("recsys_pipe")


def requested_run_dir() -> RequestedDir:
    """The directory Hydra was told to use, if any: a sweep job's, or `hydra.run.dir=...`; a plain
    run makes its own under `trainer.output_dir`."""
    from recsys_pipe.cli.hydra_adapter import hydra_runtime

    runtime = hydra_runtime()
    if runtime is None:
        return RequestedDir()
    if runtime.multirun:
        return RequestedDir(os.path.abspath(runtime.output_dir), "hydra.sweep.dir", sweep=True)
    if any(o.startswith("hydra.run.dir=") for o in runtime.hydra_overrides):
        return RequestedDir(os.path.abspath(runtime.output_dir), "hydra.run.dir")
    return RequestedDir()


@dataclass(frozen=True)
class Outcome:
    """How a command's work ended: preempted (SIGTERM, checkpoint saved) or not, and the fields
    for `status.json` (step, checkpoint, eval, ...)."""

    preempted: bool = False
    fields: dict[str, Any] | None = None


@dataclass(frozen=True)
class Launch:
    """One rank's launch of a run: the run train's pre-flight accepted (`CheckedRun`) and the
    directory it is to run in, checked before any process group starts."""

    cfg: DictConfig
    checked: CheckedRun
    requested: RequestedDir

    @property
    def run(self) -> RunConfig:
        """The validated run config."""
        return self.checked.run

    @property
    def plan(self) -> CompiledPlan:
        """The run's compiled plan."""
        return self.checked.plan

    @classmethod
    def prepare(cls, cfg: DictConfig, schema: type[RunConfig] = RunConfig, check: CommandCheck | None = None) -> Launch:
        """Every check of `check_run`, then the output directory (or the one Hydra was told to
        use); ConfigError (with config paths) for the first bad one."""
        from recsys_pipe.runtime import check_output_dir, check_unused

        checked = check_run(cfg, schema, check)
        requested = requested_run_dir()
        if requested.path is None:
            check_output_dir(checked.run.trainer.output_dir)
        elif not requested.sweep:  # a sweep job's directory is claimed (atomically) by rank 0 later:
            check_unused(requested.path, requested.key)  # checking it here would race with a faster rank 0
        return cls(cfg, checked, requested)

    def start(self, prog: str) -> tuple[RunSession, Path | None]:
        """Start this rank's session, agree on the checkpoint to resume from (rank 0's: `latest`
        must mean the same directory on every rank) and, on rank 0, write the run's config.yaml.
        ConfigError if the requested run directory was taken meanwhile; SystemExit(130) after a
        Ctrl-C once the session started (recorded in status.json)."""
        session = RunSession.start(
            prog, self.run.trainer, self.requested, self.run.debug, plan=self.run.pipeline.name, resumed_from=None
        )
        try:
            return session, self._started(session)
        except KeyboardInterrupt:  # Ctrl-C while the session starts: recorded, the group left, 130
            code = session.interrupted(0, checkpoint=None)
            _ctrl_c.settle(0)  # this Ctrl-C, consumed
            raise SystemExit(session.close(code)) from None

    def _started(self, session: RunSession) -> Path | None:
        """The checkpoint every rank resumes from (rank 0's), and the run's config.yaml and first lines."""
        import torch.distributed as dist

        _ctrl_c.pause_point("start")
        resume = [self.checked.resume.path if session.info.is_main else None]
        dist.broadcast_object_list(resume, src=0)
        if resume[0] is not None:
            session.status.info["resumed_from"] = str(resume[0])
        info = session.info
        if info.is_main:
            for path, why in self.checked.resume.skipped:
                log.info("trainer.resume_from=latest: skipped %s, a checkpoint of another experiment (%s)", path, why)
            container = OmegaConf.to_container(self.cfg, resolve=True)
            with open(os.path.join(session.run_dir, "config.yaml"), "w") as f:
                f.write(OmegaConf.to_yaml({k: v for k, v in container.items() if k != "hydra"}))
            log.info(
                "run dir %s | plan %s | %d rank(s) on %s (%s)",
                session.run_dir,
                self.run.pipeline.name,
                info.world_size,
                info.device,
                info.backend,
            )
            for note in self.checked.start_notes():
                log.warning("%s", note)
        return resume[0]


def run_job(
    cfg: DictConfig,
    prog: str,
    work: Callable[[Launch, Trainer, Path | None], Outcome],
    schema: type[RunConfig] = RunConfig,
    check: CommandCheck | None = None,
) -> None:
    """One job of a command: prepare (bad input exits 2 before any process group), start the
    session, build the trainer, `work(launch, trainer, resume)`, close; exits with the job's
    code unless it is 0."""
    from recsys_pipe.cli.console import show_library_warnings
    from recsys_pipe.cli.reporting import report_config_error

    show_library_warnings(int(os.environ.get("RANK", 0)), cfg.get("debug", False) is True)
    launch = Launch.prepare(cfg, schema, check)  # no process group yet: a bad input exits 2 here
    _ctrl_c.raise_if_received()  # a Ctrl-C while the model's modules loaded, which one of them swallowed
    try:
        session, resume = launch.start(prog)
    except ConfigError as exc:  # e.g. the named run directory was taken meanwhile
        report_config_error(exc, prog, started=True)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    previous = signal.getsignal(signal.SIGINT)
    try:
        # returns with Ctrl-C ignored: the outcome is recorded, the group is left in order
        code = _supervised(launch, session, prog, lambda trainer: work(launch, trainer, resume))
        code = _ctrl_c.settle(session.close(code, keep_group=launch.requested.sweep))  # a Ctrl-C while closing: 130
    finally:  # the process goes on (a sweep's next job): Ctrl-C works again
        signal.signal(signal.SIGINT, previous)
    if code:
        raise SystemExit(code)


def _supervised(launch: Launch, session: RunSession, prog: str, work: Callable[[Trainer], Outcome]) -> int:
    """Build and run `work`; returns the exit code and records the outcome in status.json."""
    from recsys_pipe.cli.reporting import report_config_error
    from recsys_pipe.runtime.preemption import CtrlC

    trainer = None
    ctrl_c = CtrlC()
    # what SIGINT does once the handlers below are gone again: it is remembered, and the command
    # exits 130 (the run's outcome is then being recorded and the process group left; `run_job`
    # restores Ctrl-C)
    _ctrl_c.record()
    try:
        # a Ctrl-C asks every rank to stop after a step and checkpoint (130), as SIGTERM does (75),
        # also while the parts are built: the loop stops after its first step; a second Ctrl-C
        # stops at once, saving nothing (KeyboardInterrupt, `ctrl_c`)
        with ctrl_c, session.stop.interrupts():
            trainer = launch.checked.build(session)
            outcome = work(trainer)
    except KeyboardInterrupt:
        return _interrupted(session, trainer)
    except BaseException as exc:  # every failure is recorded, then the rank exits
        if ctrl_c.during_failure() and is_communication_error(exc):  # a peer that stopped on the same Ctrl-C
            return _interrupted(session, trainer)
        bad_input = config_error_in(exc)  # found late: a checkpoint that does not fit, an undeclared collective
        if bad_input is not None:
            report_config_error(bad_input, prog, started=True)
        code = session.failed(exc, _user_code_owners(launch.run))
        if trainer is not None:
            trainer.reporter.close()
        return code
    trainer.close()
    return session.completed(outcome.preempted, **(outcome.fields or {}))


def _user_code_owners(run: RunConfig) -> dict[str, str]:
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


def _interrupted(session: RunSession, trainer: Trainer | None) -> int:
    previous = signal.getsignal(signal.SIGINT)
    _ctrl_c.record()  # torchrun forwards a second SIGINT: finish cleaning up (the code is 130 anyway)
    try:
        # the last checkpoint published before the Ctrl-C (one being written is not: `.partial`)
        checkpoint = trainer.checkpointer.last_path if trainer is not None else None
        code = session.interrupted(trainer.step if trainer is not None else 0, checkpoint=checkpoint)
        if trainer is not None:
            trainer.close()
    finally:  # the process goes on (a caller of `run`, the next job): Ctrl-C works again
        _ctrl_c.settle(0)  # a second Ctrl-C while cleaning up is this same interruption: consumed
        signal.signal(signal.SIGINT, previous)
    return code
