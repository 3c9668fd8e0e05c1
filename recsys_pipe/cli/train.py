"""`recsys-train`: validate the config, start the process group, train, tear down cleanly.

    recsys-train pipeline=serial trainer.max_steps=20
    torchrun --nproc_per_node 2 --no-python recsys-train pipeline=hstu_prefetch

Every config problem (including an invalid plan or a task `fn` that does not import) exits 2
on every rank before any process group starts. Rank 0 alone writes the run directory.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from recsys_pipe.cli._hydra import hydra_app
from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.train.config import load_run_config
from recsys_pipe.train.plan import training_plan

__all__ = ["train_task", "run", "main"]

log = logging.getLogger("recsys_pipe")


def _setup_logging(rank: int, run_dir: str) -> None:
    """Rank 0: INFO to the console and to train.log; other ranks: warnings only."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    fmt = logging.Formatter(f"[%(asctime)s][rank {rank}][%(levelname)s] %(message)s", "%H:%M:%S")
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(fmt)
    root.addHandler(console)
    if rank == 0:
        file = logging.FileHandler(os.path.join(run_dir, "train.log"))
        file.setFormatter(fmt)
        root.addHandler(file)
    root.setLevel(logging.WARNING)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def train_task(cfg: DictConfig) -> None:
    run = load_run_config(cfg)
    plan = training_plan(run)  # compiled once, task functions imported, before any group starts
    from recsys_pipe.train.dense_ddp import check_dense_ddp
    from recsys_pipe.train.distributed import resolve_device

    try:
        device = resolve_device(run.trainer.device)
    except RuntimeError as exc:
        raise ConfigError(ConfigProblem("trainer.device", str(exc))) from None
    check_dense_ddp(run, device.type)

    import torch.distributed as dist

    from recsys_pipe.train import Trainer, init_distributed, shared_run_dir, teardown

    info = init_distributed(run.trainer.device, run.trainer.backend)
    trainer = None
    try:
        run_dir = shared_run_dir(run.trainer.output_dir, "recsys-train")
        _setup_logging(info.rank, run_dir)
        if info.is_main:
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
        trainer = Trainer(run, plan, info, run_dir)
        summary = trainer.fit()
        if info.is_main:
            last = summary.evals[-1] if summary.evals else {}
            log.info(
                "trained %d steps, %d samples, %.1f samples/s; loss %.4f -> %.4f%s",
                summary.steps,
                summary.samples,
                summary.samples_per_s,
                summary.first_loss or float("nan"),
                summary.last_loss or float("nan"),
                f"; eval auc {summary.evals[0]['auc']:.4f} -> {last['auc']:.4f}" if last else "",
            )
    except KeyboardInterrupt:
        log.warning("interrupted: stopping without a further step (the last completed optimizer step stands)")
        if trainer is not None:
            trainer.close()
            trainer = None
        if dist.is_initialized():  # no barrier: a peer may be stuck in a collective
            dist.destroy_process_group()
        raise SystemExit(130) from None
    finally:
        if trainer is not None:
            trainer.close()
    teardown()


_app = hydra_app(train_task, config_name="train", prog="recsys-train")


def run(argv: Sequence[str] | None = None) -> int:
    """Run `recsys-train` in-process with `argv`; returns the exit code."""
    return _app.run(argv)


def main() -> None:
    """Console-script entry point. Exits with os._exit after flushing: gloo's worker threads
    can abort an orderly interpreter shutdown (seen ~1 run in 10)."""
    code = _app.run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
