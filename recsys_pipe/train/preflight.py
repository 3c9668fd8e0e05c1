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

from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem
from recsys_pipe.data import RankData
from recsys_pipe.train.config import RunConfig, load_run_config
from recsys_pipe.train.plan import training_plan

__all__ = ["CommandCheck", "check_inputs", "check_run", "run_device"]

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
) -> tuple[RunConfig, CompiledPlan, RankData, Path | None]:
    """What a run refuses before any process group starts, except its directory: the config,
    the compiled plan, the device, `resume_from`, how the model is spread over this job's ranks
    on this device (`Parallelism.check`), this rank's data and the model and eval dump against
    it (`check_inputs`), and the command's own `check`. A sweep runs it for every job before
    the first one starts."""
    from recsys_pipe.train.build import rank_data
    from recsys_pipe.train.checkpoint import resolve_resume
    from recsys_pipe.train.parallel import parallelism_of

    run = load_run_config(cfg, schema)
    plan = training_plan(run)
    device = run_device(run.trainer)
    resume = resolve_resume(run.trainer.resume_from, run.trainer.output_dir, run.model.name)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    parallelism_of(run).check(world_size, device.type)
    data = rank_data(run, rank, world_size)
    check_inputs(run, data)
    if check is not None:
        check(run, plan, data)
    return run, plan, data, resume
