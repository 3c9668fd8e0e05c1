"""The one start-up path of every command that trains a model (`recsys-train`,
`recsys-profile`) and of the checks before a sweep (`Launch.check`).

Before any process group starts, each rank checks everything it can (`Launch.prepare`): the
config, the plan (task code imported), the device, `resume_from`, the model's distribution over
the ranks, its share of the data (and the model against it) and the output directory. A
problem there exits 2 with `error: <path>: <message>`. Then `run_job` starts the rank's
`RunSession` (process group, run directory with `config.yaml` and `status.json`, logging, peer
health, the SIGTERM agreement), builds the `Trainer` from finished parts and runs the
command's work under one supervision: Ctrl-C, failures (the first one recorded in
`status.json`), bad input found late and preemption end every command the same way.
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
from recsys_pipe.data import RankData
from recsys_pipe.runtime.failures import EXIT_CONFIG_ERROR, config_error_in, is_communication_error
from recsys_pipe.runtime.session import RequestedDir, RunSession
from recsys_pipe.train.config import RunConfig, load_run_config
from recsys_pipe.train.plan import pipelining_without_effect, training_plan

if TYPE_CHECKING:
    from recsys_pipe.train import Trainer

__all__ = ["Launch", "Outcome", "requested_run_dir", "run_job"]

log = logging.getLogger("recsys_pipe")

#: a command's own checks of its run, plan and this rank's data (ConfigError), after the shared ones
CommandCheck = Callable[[Any, CompiledPlan, RankData], None]


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
    """One rank's launch of a run, checked before any process group starts."""

    cfg: DictConfig
    run: RunConfig
    plan: CompiledPlan
    requested: RequestedDir
    data: RankData
    #: the checkpoint this rank found for `trainer.resume_from` (rank 0's is used: `start`)
    resume: Path | None

    @classmethod
    def prepare(cls, cfg: DictConfig, schema: type[RunConfig] = RunConfig, check: CommandCheck | None = None) -> Launch:
        """Every check of `check_run`, then the output directory (or the one Hydra was told to
        use); ConfigError (with config paths) for the first bad one."""
        from recsys_pipe.runtime import check_output_dir, check_unused

        run, plan, data, resume = check_run(cfg, schema, check)
        requested = requested_run_dir()
        if requested.path is None:
            check_output_dir(run.trainer.output_dir)
        elif not requested.sweep:  # a sweep job's directory is claimed (atomically) by rank 0 later:
            check_unused(requested.path, requested.key)  # checking it here would race with a faster rank 0
        return cls(cfg, run, plan, requested, data, resume)

    def start(self, prog: str) -> tuple[RunSession, Path | None]:
        """Start this rank's session, agree on the checkpoint to resume from (rank 0's: `latest`
        must mean the same directory on every rank) and, on rank 0, write the run's config.yaml.
        ConfigError if the requested run directory was taken meanwhile."""
        import torch.distributed as dist

        session = RunSession.start(
            prog, self.run.trainer, self.requested, self.run.debug, plan=self.run.pipeline.name, resumed_from=None
        )
        resume = [self.resume if session.info.is_main else None]
        dist.broadcast_object_list(resume, src=0)
        if resume[0] is not None:
            session.status.info["resumed_from"] = str(resume[0])
        info = session.info
        if info.is_main:
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
            warning = pipelining_without_effect(self.plan, self.run)
            if warning is not None:
                log.warning("%s", warning)
        return session, resume[0]

    def build(self, session: RunSession) -> Trainer:
        """The build phase: every part the loop runs on, from the config, once; the trainer over them."""
        from recsys_pipe.train import Trainer, build_parts
        from recsys_pipe.train.retrieval_eval import eval_dump_path

        run = self.run  # a relative trainer.eval_dump is a path inside the run directory
        eval_dump = eval_dump_path(run.trainer.eval_dump, session.run_dir)
        run = run.model_copy(update={"trainer": run.trainer.model_copy(update={"eval_dump": eval_dump})})
        if session.info.is_main and run.trainer.eval_dump is not None:
            log.info("trainer.eval_dump: the best evaluation's test ranks go to %s", run.trainer.eval_dump)
        parts = build_parts(run, self.plan, session.info, session.run_dir, data=self.data)
        return Trainer(parts, stop=session.stop, health=session.health)


def check_run(
    cfg: DictConfig, schema: type[RunConfig] = RunConfig, check: CommandCheck | None = None
) -> tuple[RunConfig, CompiledPlan, RankData, Path | None]:
    """What a run refuses before any process group starts, except its directory: the config,
    the compiled plan, the device, `resume_from`, how the model is spread over this job's ranks
    on this device (`Parallelism.check`), this rank's data and the model and eval dump against
    it (`check_inputs`), and the command's own `check`. A sweep runs it for every job before
    the first one starts."""
    from recsys_pipe.cli.preflight import check_inputs, run_device
    from recsys_pipe.train.build import rank_data
    from recsys_pipe.train.checkpoint import resolve_resume
    from recsys_pipe.train.parallel import Topology, parallelism_of

    run = load_run_config(cfg, schema)
    plan = training_plan(run)
    device = run_device(run.trainer)
    problems = run.model.check_device(device.type)
    if problems:
        raise ConfigError(problems)
    parallelism = parallelism_of(run)
    topology = Topology.of_job(device.type)
    parallelism.check(topology)
    resume = resolve_resume(run.trainer.resume_from, run.trainer.output_dir, run.model.name, parallelism.table_shapes)
    rank, world_size = int(os.environ.get("RANK", 0)), topology.world_size
    data = rank_data(run, rank, world_size)
    check_inputs(run, data)
    if check is not None:
        check(run, plan, data)
    return run, plan, data, resume


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
        code = session.close(code, keep_group=launch.requested.sweep)
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
    # what SIGINT does once the handlers below are gone again: nothing (the run's outcome is then
    # being recorded and the process group left; `run_job` restores Ctrl-C)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        # a Ctrl-C asks every rank to stop after a step and checkpoint (130), as SIGTERM does (75),
        # also while the parts are built: the loop stops after its first step; a second Ctrl-C
        # stops at once, saving nothing (KeyboardInterrupt, `ctrl_c`)
        with ctrl_c, session.stop.interrupts():
            trainer = launch.build(session)
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
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun forwards a second SIGINT: finish cleaning up
    try:
        code = session.interrupted(trainer.step if trainer is not None else 0)
        if trainer is not None:
            trainer.close()
    finally:  # the process goes on (a caller of `run`, the next job): Ctrl-C works again
        signal.signal(signal.SIGINT, previous)
    return code
