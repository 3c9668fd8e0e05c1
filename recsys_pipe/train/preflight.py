"""Checks of the machine a run needs and of the inputs as read, shared by the CLIs that start a
process group (`recsys-train` runs them in `Launch.prepare`, and `--check` runs the same).

Why here and not in the config schema: whether CUDA is visible is a fact about this machine,
not about the config, but it is still the user's input that is wrong (`trainer.device=cuda` or
`trainer.backend=nccl` on a machine without a GPU), so it is a ConfigError (exit 2, one line)
found before any process group starts, never a traceback from inside `init_process_group`.

`check_inputs` runs the checks that need the data as read but no process group; each lives
with the component it concerns (the model's `check_spec`, the retrieval evaluation's
`check_eval_dump`), so that the run and `--check` find the same problems. What the model's
spread over the ranks needs of the device is `Parallelism.check`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from recsys_pipe import _ctrl_c
from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem
from recsys_pipe.data import RankData
from recsys_pipe.train.checkpoint import ResumeChoice
from recsys_pipe.train.config import RunConfig, load_run_config
from recsys_pipe.train.plan import training_plan

__all__ = ["CommandCheck", "check_global_batch", "check_inputs", "check_resume", "check_run", "run_device"]

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


def check_run(
    cfg: DictConfig, schema: type[RunConfig] = RunConfig, check: CommandCheck | None = None
) -> tuple[RunConfig, CompiledPlan, RankData, ResumeChoice]:
    """What a run refuses before any process group starts, except its directory: the config,
    the compiled plan, the device, `resume_from` (`latest`: of this experiment, `check_resume`),
    how the model is spread over this job's ranks on this device (`Parallelism.check`), this
    rank's data and the model and eval dump against it (`check_inputs`), and the command's own
    `check`. A sweep runs it for every job before the first one starts."""
    from recsys_pipe.train.build import rank_data
    from recsys_pipe.train.parallel import parallelism_of

    run = load_run_config(cfg, schema)
    _ctrl_c.pause_point("check")
    plan = training_plan(run)
    device = run_device(run.trainer)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    resume = check_resume(run, world_size)
    parallelism_of(run).check(world_size, device.type)
    data = rank_data(run, rank, world_size)
    check_inputs(run, data)
    if resume.path is not None and data.stream is not None:
        check_global_batch(run, world_size, resume.path)
    if check is not None:
        check(run, plan, data)
    return run, plan, data, resume


def check_resume(run: RunConfig, world_size: int) -> ResumeChoice:
    """The checkpoint `trainer.resume_from` names; `latest` takes the newest of this experiment
    (the same model, data and global batch on `world_size` ranks: `recsys_pipe.train.fingerprint`)."""
    from recsys_pipe.train.checkpoint import choose_resume
    from recsys_pipe.train.fingerprint import fingerprint

    trainer = run.trainer
    mine = fingerprint(run, world_size) if trainer.resume_from == "latest" else None
    return choose_resume(trainer.resume_from, trainer.output_dir, run.model.name, mine)


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
