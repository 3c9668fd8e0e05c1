"""Evaluation of the model being trained, through its own plan runner (the training plan with the
optimizer work switched off) over held-out data.

Because evaluation has a plan runner of its own, the training plan runner keeps its in-flight batches
across an evaluation: no training batch is dropped or replayed, and none leaks into evaluation.
Two kinds: a ranking source's held-out loader (loss, log loss, per-task AUC, aggregated over all
ranks) and a retrieval source's validation/test splits (`RetrievalEvaluation`).

An `Evaluator` is a finished part of a run (`recsys_pipe.train.build.build_parts`) and decides
itself when it is due (`due(step, epochs_done)`); a command that only evaluates builds the same
part and calls `evaluate_at(step)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch.utils.data import DataLoader

from recsys_pipe.engine import PlanRunner
from recsys_pipe.train.retrieval_eval import RetrievalEvaluation
from recsys_pipe.train.rng import RngState
from recsys_pipe.train.state import TrainState

__all__ = ["Evaluator"]


class Evaluator:
    """Evaluates the model of `state` over `loader` (ranking) or through `retrieval`.

    `make_plan_runner` builds the evaluation plan runner on first use: its executor threads exist only
    in runs that evaluate, and it is built after the training plan runner's bootstrap (which
    rewrites a torchrec model for the plan's lookaheads). `every` and `every_epochs` are
    `trainer.eval_every` and `trainer.eval_epochs`; `rng` gives evaluation its own random
    stream.
    """

    def __init__(
        self,
        state: TrainState,
        num_tasks: int,
        loader: DataLoader | None,
        retrieval: RetrievalEvaluation | None,
        make_plan_runner: Callable[[TrainState], PlanRunner],
        rng: RngState,
        every: int = 0,
        every_epochs: int = 0,
    ):
        self.state, self.num_tasks, self.loader, self.retrieval = state, num_tasks, loader, retrieval
        self._make_plan_runner = make_plan_runner
        self.rng, self.every, self.every_epochs = rng, every, every_epochs
        self.plan_runner: PlanRunner | None = None

    @property
    def has_data(self) -> bool:
        """Whether there is anything to evaluate on."""
        return self.loader is not None or self.retrieval is not None

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates while it trains (`trainer.eval_every` > 0 and held-out data)."""
        return self.has_data and self.every > 0

    def due(self, step: int, epochs_done: int | None = None) -> bool:
        """Whether to evaluate after `step`: every `trainer.eval_every` steps, and at the end of
        every `trainer.eval_epochs`-th epoch (`epochs_done`: the epochs completed when `step`
        ended one, else None)."""
        if not self.enabled:
            return False
        epoch_eval = epochs_done is not None and self.every_epochs > 0 and epochs_done % self.every_epochs == 0
        return epoch_eval or step % self.every == 0

    def evaluate_at(self, step: int, record_batches: bool = False) -> dict[str, Any]:
        """`evaluate` at training step `step`, drawing from its own random stream
        (`RngState.evaluation`): training's draws, and so its losses, are the same whether and
        whenever it evaluates."""
        with self.rng.evaluation(step):
            return self.evaluate(record_batches)

    def evaluate(self, record_batches: bool = False) -> dict[str, Any]:
        """Loss, log loss (binary cross-entropy per scored row and task) and per-task AUC over the
        held-out loader, aggregated over all ranks; for a retrieval source, its ranking metrics
        (`RetrievalEvaluation`). With `record_batches`, also this rank's evaluated batches in
        order: `sample_ids` and `batch_losses` (which batch each output belongs to, for the
        checks that switching to evaluation mislabels nothing)."""
        if self.plan_runner is None:  # same plan and streams, its own executor threads
            self.plan_runner = self._make_plan_runner(self.state.for_eval())
        model = self.state.model
        model.train(False)
        try:
            if self.retrieval is not None:
                return self.retrieval.evaluate(self.plan_runner)
            return self._ranking(self.plan_runner, record_batches)
        finally:
            model.train(True)

    def _ranking(self, runner: PlanRunner, record_batches: bool) -> dict[str, Any]:
        # imported here, by the runs that evaluate a ranking model: torchmetrics imports matplotlib's
        # pyplot, about half a second of every process start (recsys-plan, --check, runs without
        # evaluation) otherwise
        from torchmetrics import MeanMetric
        from torchmetrics.classification import BinaryAUROC

        assert self.loader is not None
        device = self.state.device
        aurocs = [BinaryAUROC().to(device) for _ in range(self.num_tasks)]  # any task count, 1 included
        mean_loss = MeanMetric().to(device)
        log_loss = MeanMetric().to(device)
        sample_ids: list[list[int]] = []
        batch_losses: list[float] = []
        for result in runner.iterate(self.loader):
            if record_batches:
                sample_ids.append(result.sample_ids.tolist())
                batch_losses.append(float(result.loss))
            logits = result.logits.float()  # bf16 under trainer.precision=bf16
            for task, auroc in enumerate(aurocs):
                auroc.update(logits[:, task], result.labels[:, task].int())
            mean_loss.update(result.loss.float())
            log_loss.update(F.binary_cross_entropy_with_logits(logits, result.labels, reduction="none"))
        per_task = [float(auroc.compute()) for auroc in aurocs]
        metrics: dict[str, Any] = {
            "eval_loss": float(mean_loss.compute()),
            "log_loss": float(log_loss.compute()),
            "auc": sum(per_task) / self.num_tasks,
            "auc_per_task": [round(a, 5) for a in per_task],
        }
        if record_batches:
            metrics.update(sample_ids=sample_ids, batch_losses=batch_losses)
        return metrics

    def close(self) -> None:
        """Shut down the evaluation plan runner's worker threads, if it was built."""
        if self.plan_runner is not None:
            self.plan_runner.shutdown()
