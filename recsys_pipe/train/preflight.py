"""The pre-flight: everything a run refuses before any process group starts, and the build
entry point of a run that passed it. The commands (`recsys_pipe.cli.launch`) call these two:
`check_run(cfg)` for the checks (`recsys-train` runs them in `Launch.prepare`, `--check` and the
sweep check run the same) and `CheckedRun.build(session)` for the trainer; what they do with a
run in between is supervision (run directory, status, signals).

Why the machine is checked here and not in the config schema: whether CUDA is visible is a fact
about this machine, not about the config, but it is still the user's input that is wrong
(`trainer.device=cuda` or `trainer.backend=nccl` on a machine without a GPU), so it is a
ConfigError (exit 2, one line) found before any process group starts, never a traceback from
inside `init_process_group`.

`check_inputs` runs the checks that need the data as read but no process group; each lives
with the component it concerns (the model's `check_spec`, the retrieval evaluation's
`check_eval_dump`), so that the run and `--check` find the same problems. What the model's
spread over the ranks needs of the device is `Parallelism.check`'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from recsys_pipe import _ctrl_c
from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem
from recsys_pipe.data import RankData
from recsys_pipe.train.config import RunConfig, load_run_config
from recsys_pipe.train.fingerprint import ResumeChoice
from recsys_pipe.train.plan import pipelining_without_effect, training_plan

if TYPE_CHECKING:
    from recsys_pipe.runtime.session import RunSession
    from recsys_pipe.train.trainer import Trainer

__all__ = [
    "CheckedRun",
    "CommandCheck",
    "check_global_batch",
    "check_inputs",
    "check_plan",
    "check_resume",
    "check_run",
    "run_device",
]

log = logging.getLogger("recsys_pipe")

#: a command's own checks of its run, plan and this rank's data (ConfigError), after the shared ones
CommandCheck = Callable[[Any, CompiledPlan, RankData], None]


def run_device(trainer: Any) -> Any:
    """The `torch.device` this rank trains on (`trainer.device`), checked against
    `trainer.backend`: NCCL needs CUDA tensors."""
    from recsys_pipe.runtime import resolve_device

    try:
        device = resolve_device(trainer.device)
    except RuntimeError as exc:
        raise ConfigError(ConfigProblem("trainer.device", str(exc))) from None
    if trainer.backend == "nccl" and device.type != "cuda":
        where = "no CUDA device is visible" if trainer.device == "auto" else f"trainer.device={trainer.device}"
        raise ConfigError(
            ConfigProblem("trainer.backend", f"nccl needs CUDA and {where}; use trainer.backend=gloo (or auto)")
        )
    return device


def check_inputs(run: Any, data: Any) -> None:
    """ConfigError for what `run` would refuse after start-up, given this rank's `data` (a
    `RankData`, read): the model against the data as read, and `trainer.eval_dump`."""
    from recsys_pipe.train.retrieval_eval import check_eval_dump

    problems = run.model.check_spec(data.spec)
    if problems:
        raise ConfigError(problems)
    check_eval_dump(run.trainer.eval_dump, run.trainer.eval_every, data)


@dataclass(frozen=True)
class CheckedRun:
    """A run the pre-flight accepted (`check_run`), ready to be built once its session started:
    the run config, its compiled plan, this rank's data (read once, used by the run) and the
    checkpoint this rank found for `trainer.resume_from`."""

    run: RunConfig
    plan: CompiledPlan
    data: RankData
    #: the checkpoint this rank found for `trainer.resume_from`, and the newer checkpoints of
    #: other experiments `latest` passed over
    resume: ResumeChoice

    def start_notes(self) -> list[str]:
        """What the main rank logs when the run starts: a plan that pipelines work the model does
        not have (`pipelining_without_effect`)."""
        warning = pipelining_without_effect(self.plan, self.run)
        return [] if warning is None else [warning]

    def memory_check(self) -> tuple[str, str | None]:
        """What `--check` says of this job's memory (`recsys_pipe.train.memory.check_memory`):
        the estimate's one line, and a warning when its largest rank does not fit (else None)."""
        from recsys_pipe.train.memory import check_memory
        from recsys_pipe.train.plan import planned_device_type

        return check_memory(self.run, self.plan, planned_device_type(self.run.trainer.device))

    def build(self, session: RunSession) -> Trainer:
        """The build phase in `session` (its process group, run directory, stop request and peer
        health): every part the loop runs on, once, from the config; the trainer over them. A
        relative `trainer.eval_dump` becomes a path inside the run directory."""
        from recsys_pipe.train.build import build_parts
        from recsys_pipe.train.retrieval_eval import eval_dump_path
        from recsys_pipe.train.trainer import Trainer

        run = self.run
        eval_dump = eval_dump_path(run.trainer.eval_dump, session.run_dir)
        run = run.model_copy(update={"trainer": run.trainer.model_copy(update={"eval_dump": eval_dump})})
        if session.info.is_main and run.trainer.eval_dump is not None:
            log.info("trainer.eval_dump: the best evaluation's test ranks go to %s", run.trainer.eval_dump)
        parts = build_parts(run, self.plan, session.info, session.run_dir, data=self.data)
        return Trainer(parts, stop=session.stop, health=session.health)


def check_plan(cfg: DictConfig, schema: type[RunConfig] = RunConfig) -> tuple[RunConfig, CompiledPlan]:
    """The config validated (`RunConfig`, or the command's `schema`) and its plan compiled: the
    check of every job of a sweep before Hydra runs it (ConfigError, with config paths)."""
    run = load_run_config(cfg, schema)
    return run, training_plan(run)


def check_run(cfg: DictConfig, schema: type[RunConfig] = RunConfig, check: CommandCheck | None = None) -> CheckedRun:
    """What a run refuses before any process group starts, except its directory: the config,
    the compiled plan, the device, how the model is spread over this job's ranks on this device
    and hosts (`Parallelism.check`), `resume_from` (`latest`: of this experiment, `check_resume`;
    the checkpoint's table shapes included), this rank's data and the model and eval dump against
    it (`check_inputs`), and the command's own `check`. A sweep runs it for every job before the
    first one starts."""
    from recsys_pipe.train.build import rank_data
    from recsys_pipe.train.managed import check_resume_ranks
    from recsys_pipe.train.parallel import Topology, parallelism_of

    run, plan = check_plan(cfg, schema)
    _ctrl_c.pause_point("check")
    device = run_device(run.trainer)
    problems = run.model.check_device(device.type)
    if problems:
        raise ConfigError(problems)
    parallelism = parallelism_of(run)
    topology = Topology.of_job(device.type)  # WORLD_SIZE, LOCAL_WORLD_SIZE as torchrun sets them
    parallelism.check(topology)
    rank, world_size = int(os.environ.get("RANK", 0)), topology.world_size
    resume = check_resume(run, world_size, parallelism.table_shapes)
    check_resume_ranks(resume.path, world_size)
    data = rank_data(run, rank, world_size)
    check_inputs(run, data)
    if resume.path is not None and data.stream is not None:
        check_global_batch(run, world_size, resume.path)
    if check is not None:
        check(run, plan, data)
    return CheckedRun(run, plan, data, resume)


def check_resume(
    run: RunConfig, world_size: int, tables: Callable[[], Mapping[str, tuple[int, int]] | None] | None = None
) -> ResumeChoice:
    """The checkpoint `trainer.resume_from` names; `latest` takes the newest of this experiment
    (the same model, data and global batch on `world_size` ranks: `recsys_pipe.train.fingerprint`);
    `tables`: the run's torchrec tables' shapes by name, checked against the checkpoint's."""
    from recsys_pipe.train.fingerprint import choose_resume, fingerprint

    trainer = run.trainer
    mine = fingerprint(run, world_size) if trainer.resume_from == "latest" else None
    return choose_resume(trainer.resume_from, trainer.output_dir, run.model.name, mine, tables)


def check_global_batch(run: RunConfig, world_size: int, checkpoint: Path) -> None:
    """A streaming source continues an epoch exactly only at the checkpoint's global batch
    (`StreamSource.resume_layout`): another one is refused here, before the start."""
    from recsys_pipe.train.checkpoint import read_metadata, saved_world_size
    from recsys_pipe.train.fingerprint import fingerprint, saved_fingerprint

    saved = saved_fingerprint(checkpoint, saved_world_size(read_metadata(checkpoint)))
    mine = fingerprint(run, world_size)
    if saved is None or saved.global_batch == mine.global_batch:
        return
    ranks = mine.global_batch // run.data.batch_size
    per_rank, rest = divmod(saved.global_batch, ranks)
    fix = (
        f"set data.batch_size={per_rank}" if not rest else f"use a number of replicas that divides {saved.global_batch}"
    )
    raise ConfigError(
        ConfigProblem(
            "data.batch_size",
            f"the checkpoint {checkpoint} trained a global batch of {saved.global_batch} rows; this run's is "
            f"{mine.global_batch} ({ranks} replica(s) x data.batch_size={run.data.batch_size}), and the epoch "
            f"would not continue exactly: {fix}",
        )
    )
