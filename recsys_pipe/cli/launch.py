"""What `recsys-train` knows before it trains: the validated run, its compiled plan, the run
directory it was told to use, this rank's data and the checkpoint to resume from — each checked
once, before any process group starts (`Launch.prepare`) — and the session it then starts.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from recsys_pipe.config import CompiledPlan
from recsys_pipe.data import RankData
from recsys_pipe.runtime.session import RequestedDir, RunSession
from recsys_pipe.train.config import RunConfig, load_run_config
from recsys_pipe.train.plan import pipelining_without_effect, training_plan

__all__ = ["Launch", "requested_run_dir"]

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
class Launch:
    """One rank's launch of a training run, checked before any process group starts."""

    cfg: DictConfig
    run: RunConfig
    plan: CompiledPlan
    requested: RequestedDir
    data: RankData
    #: the checkpoint this rank found for `trainer.resume_from` (rank 0's is used: `start`)
    resume: Path | None

    @classmethod
    def prepare(cls, cfg: DictConfig) -> Launch:
        """Validate the config, compile the plan (task code imported), and check the device, the
        dense DDP choice, `resume_from`, this rank's data (and the model, fused optimizer and
        eval dump against it: `check_inputs`) and the output directory; ConfigError (with config
        paths) for the first bad one."""
        from recsys_pipe.cli.preflight import check_inputs, run_device
        from recsys_pipe.pp.config import check_pipeline_parallel
        from recsys_pipe.runtime import check_output_dir, check_unused
        from recsys_pipe.train.build import rank_data
        from recsys_pipe.train.checkpoint import resolve_resume
        from recsys_pipe.train.dense_ddp import check_dense_ddp

        run = load_run_config(cfg)
        plan = training_plan(run)
        device = run_device(run.trainer)
        check_dense_ddp(run, device.type)
        resume = resolve_resume(run.trainer.resume_from, run.trainer.output_dir, run.model.name)
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        check_pipeline_parallel(run, world_size)
        data = rank_data(run, rank, world_size)
        check_inputs(run, data, device.type)
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
