"""Evaluate a trained run again (`recsys-eval RUN_DIR`): the model of one of its checkpoints,
with the run's saved config (and overrides), on its held-out data, on any number of ranks.

The evaluation is the training run's own: the same parts are built (`build_parts`: data,
sharded model, the evaluation plan runner of the run's plan), the checkpoint is restored as a
resume restores it (DCP reshards the tables for this world size), and `Trainer`'s evaluation
runs at the checkpoint's step, with its random stream: AUC and log loss for a ranking model,
HR/NDCG/MRR under both protocols for a retrieval model. On the world size that trained, the
metrics equal those the training run logged after that step.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recsys_pipe.train.export import load_run, resolve_checkpoint

__all__ = ["EVAL_FILE", "RunEvaluation", "evaluate_run"]

log = logging.getLogger(__name__)

#: written into the run directory (rank 0)
EVAL_FILE = "eval.json"


@dataclass
class RunEvaluation:
    """What `evaluate_run` measured: the checkpoint, its step and the metrics record."""

    checkpoint: Path
    step: int
    metrics: dict[str, Any]


def evaluate_run(
    run_dir: str | Path, checkpoint: str | None = None, overrides: Mapping[str, Any] | None = None
) -> RunEvaluation:
    """Evaluate `run_dir`'s checkpoint (`step_N`, default the newest) on this process group's
    ranks (started here under torchrun, or one rank); rank 0 logs the training run's evaluation
    line and writes `<run_dir>/eval.json`."""
    from recsys_pipe.runtime.distributed import init_distributed, teardown
    from recsys_pipe.train.build import build_parts, rank_data
    from recsys_pipe.train.managed import check_resume_ranks
    from recsys_pipe.train.plan import training_plan
    from recsys_pipe.train.trainer import Trainer

    run_dir = Path(run_dir)
    path = resolve_checkpoint(run_dir, checkpoint)
    check_resume_ranks(path, int(os.environ.get("WORLD_SIZE", "1")), key="checkpoint")
    run = load_run(run_dir, path, overrides or {})
    plan = training_plan(run)
    info = init_distributed(run.trainer.device, run.trainer.backend, timeout_s=run.trainer.peer_timeout_s)
    trainer = None
    try:
        data = rank_data(run, info.rank, info.world_size)
        trainer = Trainer(build_parts(run, plan, info, None, data=data))
        trainer.restore(str(path))
        # the training run's own evaluation and its log line (`eval at step N: ...`)
        metrics = trainer.reporter.evaluation(trainer.step, trainer.evaluate())
        metrics = {k: v for k, v in metrics.items() if k not in ("sample_ids", "batch_losses")}
        if info.is_main:
            record = {"checkpoint": str(path), "world_size": info.world_size, **metrics}
            (run_dir / EVAL_FILE).write_text(json.dumps(record, indent=2) + "\n")
        return RunEvaluation(path, trainer.step, metrics)
    finally:
        if trainer is not None:
            trainer.close()
        teardown()
