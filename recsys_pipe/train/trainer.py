"""The training loop: one plan-driven pipeline for training, one for evaluation, same model.

Evaluation runs through its own pipeline (same plan, optimizer work switched off) over the
held-out loader, so the training pipeline keeps its in-flight batches across an evaluation:
no training batch is dropped or replayed, and no training batch leaks into evaluation.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC
from tqdm import tqdm

from recsys_pipe.config import CompiledPlan
from recsys_pipe.data.loader import make_dataloader
from recsys_pipe.engine import SchedulablePipeline, SequentialExecutor, StreamPool, ThreadedExecutor
from recsys_pipe.train.build import build_model, build_state
from recsys_pipe.train.config import RunConfig
from recsys_pipe.train.distributed import DistInfo
from recsys_pipe.train.state import TrainState
from recsys_pipe.train.tasks import StepResult
from recsys_pipe.train.torch_profile import StepWindow

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    """What a `fit` did. Per-step `losses` and `sample_ids` are kept only with
    `fit(record_steps=True)` (parity checks): a long run must not grow memory per step."""

    steps: int = 0
    samples: int = 0
    seconds: float = 0.0
    first_loss: float | None = None
    last_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    sample_ids: list[torch.Tensor] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0


def build_pipeline(plan: CompiledPlan, streams: StreamPool, state: TrainState) -> SchedulablePipeline:
    """A pipeline running `plan` on `streams`, with its own executor (and worker threads)."""
    executor = ThreadedExecutor(thread_map=dict(plan.thread_of)) if plan.threaded else SequentialExecutor()
    return SchedulablePipeline(plan.graph, streams, executor, state=state)


class Trainer:
    """Builds everything from a validated RunConfig and its compiled plan (after the process
    group exists): loaders, model, streams, the training pipeline; the evaluation pipeline is
    derived from the same plan and streams when first needed."""

    def __init__(self, run: RunConfig, plan: CompiledPlan, info: DistInfo, run_dir: str | None = None):
        self.run, self.plan, self.info, self.run_dir = run, plan, info, run_dir
        self.train_loader = make_dataloader(run.data, info.rank, info.world_size)
        eval_batches = run.trainer.eval_batches
        self.eval_loader = (
            make_dataloader(run.data, info.rank, info.world_size, split="eval", num_batches=eval_batches)
            if eval_batches
            else None
        )
        self.spec = self.train_loader.dataset.spec
        model, optimizer = build_model(run, info, self.spec)
        self.state: TrainState = build_state(run, plan, model, optimizer, info)
        self.pipeline = build_pipeline(plan, self.state.streams, self.state)
        self._eval_pipeline: SchedulablePipeline | None = None  # built after the bootstrap
        self._metrics = (
            open(  # noqa: SIM115 - closed by close()
                os.path.join(run_dir, "metrics.jsonl"), "a"
            )
            if run_dir and info.is_main
            else None
        )

    # -- loop -----------------------------------------------------------------------------------

    def fit(self, batches: Iterator | None = None, record_steps: bool = False) -> TrainSummary:
        """Train until `trainer.max_steps` or the end of the data; evaluate every
        `trainer.eval_every` steps (and before the first step).

        The loss is read back to the host only at log steps (and, with `record_steps`, every
        step): reading it every step would make the host wait for the device each iteration
        and undo the pipelining on CUDA.
        """
        cfg = self.run.trainer
        it = iter(self.train_loader) if batches is None else batches
        summary = TrainSummary()
        try:
            first = next(it)
        except StopIteration:
            raise RuntimeError("the training loader yielded no batch (check data.num_batches)") from None
        self.pipeline.seed_first_batch(it, self.state.bootstrap(first))
        if self.eval_loader is not None and cfg.eval_every:
            summary.evals.append(self._log_eval(0))
        bar = tqdm(
            total=cfg.max_steps,
            desc="train",
            unit="step",
            disable=not self.info.is_main or not cfg.progress_bar,
            dynamic_ncols=True,
        )
        window_start, window_samples = time.perf_counter(), 0
        traced = StepWindow(cfg.torch_profiler.steps, self.run_dir or ".", self.info.rank, self.pipeline)
        traced.step(0)
        start = time.perf_counter()
        while cfg.max_steps is None or summary.steps < cfg.max_steps:
            try:
                result: StepResult = self.pipeline.progress(it)
            except StopIteration:
                break
            summary.steps += 1
            traced.step(summary.steps)
            samples = result.num_samples * self.info.world_size
            summary.samples += samples
            window_samples += samples
            if record_steps:
                summary.losses.append(float(result.loss))
                summary.sample_ids.append(result.sample_ids.cpu())
            if summary.steps == 1:
                summary.first_loss = float(result.loss)
            last = result
            bar.update(1)
            if summary.steps % cfg.log_every == 0:
                now = time.perf_counter()
                loss = self._global_mean(result.loss)
                self._write(
                    {
                        "step": summary.steps,
                        "loss": loss,
                        "samples_per_s": round(window_samples / (now - window_start), 2),
                    }
                )
                bar.set_postfix(loss=f"{loss:.4f}")
                window_start, window_samples = now, 0
            if self.eval_loader is not None and cfg.eval_every and summary.steps % cfg.eval_every == 0:
                summary.evals.append(self._log_eval(summary.steps))
        summary.seconds = time.perf_counter() - start
        traced.close()
        if summary.steps:
            summary.last_loss = float(last.loss)
        bar.close()
        if self.eval_loader is not None and cfg.eval_every and summary.steps % cfg.eval_every:
            summary.evals.append(self._log_eval(summary.steps))
        return summary

    def evaluate(self) -> dict[str, Any]:
        """Loss, log loss (binary cross-entropy per scored row and task) and per-task AUC over the
        held-out loader, aggregated over all ranks."""
        assert self.eval_loader is not None
        num_tasks = self.spec.num_tasks
        aurocs = [BinaryAUROC().to(self.info.device) for _ in range(num_tasks)]  # any task count, 1 included
        mean_loss = MeanMetric().to(self.info.device)
        log_loss = MeanMetric().to(self.info.device)
        if self._eval_pipeline is None:  # same plan and streams, its own executor threads
            self._eval_pipeline = build_pipeline(self.plan, self.state.streams, self.state.for_eval())
        self.state.model.train(False)
        try:
            for result in self._eval_pipeline.iterate(self.eval_loader):
                for task, auroc in enumerate(aurocs):
                    auroc.update(result.logits[:, task], result.labels[:, task].int())
                mean_loss.update(result.loss)
                log_loss.update(F.binary_cross_entropy_with_logits(result.logits, result.labels, reduction="none"))
            per_task = [float(auroc.compute()) for auroc in aurocs]
            return {
                "eval_loss": float(mean_loss.compute()),
                "log_loss": float(log_loss.compute()),
                "auc": sum(per_task) / num_tasks,
                "auc_per_task": [round(a, 5) for a in per_task],
            }
        finally:
            self.state.model.train(True)

    def close(self) -> None:
        self.pipeline.shutdown()
        if self._eval_pipeline is not None:
            self._eval_pipeline.shutdown()
        self.state.close()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    # -- helpers --------------------------------------------------------------------------------

    def _log_eval(self, step: int) -> dict[str, Any]:
        metrics = {"step": step, **self.evaluate()}
        self._write(metrics)
        if self.info.is_main:
            log.info("eval at step %d: loss %.4f, auc %.4f", step, metrics["eval_loss"], metrics["auc"])
        return metrics

    def _global_mean(self, value: torch.Tensor) -> float:
        value = value.detach().reshape(1).clone()
        if self.info.world_size > 1:
            dist.all_reduce(value)
            value /= self.info.world_size
        return float(value)

    def _write(self, record: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()
