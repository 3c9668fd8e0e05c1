"""The training loop: one plan-driven pipeline for training, one for evaluation, same model.

Evaluation runs through its own pipeline (same plan, optimizer work switched off) over the
held-out loader, so the training pipeline keeps its in-flight batches across an evaluation:
no training batch is dropped or replayed, and no training batch leaks into evaluation.

Epochs are one continuous stream of batches (`RankData.train_loader(epochs, start)`): the
pipeline never drains or restarts at an epoch boundary, it just keeps pulling; the loop notices
an epoch end by counting trained batches. Checkpoints store the position of the next batch to
*train*: batches already pulled, moved or input-distributed for later steps are simply pulled
again from that position by a resumed run, which refills the ring exactly as the uninterrupted
run had it.
"""

from __future__ import annotations

import logging
import random
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem
from recsys_pipe.data import RankData
from recsys_pipe.engine import SchedulablePipeline, SequentialExecutor, StreamPool, ThreadedExecutor
from recsys_pipe.runtime.distributed import DistInfo
from recsys_pipe.runtime.health import PeerHealth
from recsys_pipe.runtime.preemption import StopRequest
from recsys_pipe.runtime.verify import CollectiveGuard
from recsys_pipe.train.build import build_model, build_state
from recsys_pipe.train.checkpoint import Checkpointer, load_checkpoint
from recsys_pipe.train.config import RunConfig
from recsys_pipe.train.grad_accumulation import GradAccumulation
from recsys_pipe.train.metrics import MetricsWriter
from recsys_pipe.train.optim import TrainOptimizer
from recsys_pipe.train.retrieval_eval import RetrievalEvaluation
from recsys_pipe.train.rng import RngState
from recsys_pipe.train.state import TrainState
from recsys_pipe.train.tasks import StepResult
from recsys_pipe.train.torch_profile import StepWindow

log = logging.getLogger(__name__)

#: `TrainSummary.stop_reason` values
MAX_STEPS, EPOCHS_DONE, DATA_EXHAUSTED, PREEMPTED = "max_steps reached", "epochs done", "data exhausted", "preempted"


@dataclass
class TrainSummary:
    """What a `fit` did. Per-step `losses` and `sample_ids` are kept only with
    `fit(record_steps=True)` (parity checks): a long run must not grow memory per step."""

    steps: int = 0
    start_step: int = 0
    samples: int = 0
    seconds: float = 0.0
    first_loss: float | None = None
    last_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    sample_ids: list[torch.Tensor] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    #: why training stopped: one of MAX_STEPS, EPOCHS_DONE, DATA_EXHAUSTED, PREEMPTED
    stop_reason: str = ""
    #: the last checkpoint written (a directory), if any
    checkpoint: str | None = None

    @property
    def end_step(self) -> int:
        return self.start_step + self.steps

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    def describe(self) -> str:
        """One line for the log: steps, samples, speed, loss and eval AUC from first to last."""
        evals = ""
        if self.evals and "auc" in self.evals[-1]:  # retrieval evaluations log their own line
            evals = f"; eval auc {self.evals[0]['auc']:.4f} -> {self.evals[-1]['auc']:.4f}"
        return (
            f"trained {self.steps} steps ({self.start_step} -> {self.end_step}), {self.samples} samples, "
            f"{self.samples_per_s:.1f} samples/s; loss {self.first_loss or float('nan'):.4f} -> "
            f"{self.last_loss or float('nan'):.4f}{evals}"
        )


def build_pipeline(plan: CompiledPlan, streams: StreamPool, state: TrainState) -> SchedulablePipeline:
    """A pipeline running `plan` on `streams`, with its own executor (and worker threads)."""
    executor = ThreadedExecutor(thread_map=dict(plan.thread_of)) if plan.threaded else SequentialExecutor()
    return SchedulablePipeline(plan.graph, streams, executor, state=state)


class _Progress:
    """The checkpointed part of the loop itself: step, data position and the run's data layout
    (so a resume on another world size can map the position onto its own batches)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {
            "step": t.step,
            "position": t.position,
            "batches_per_epoch": t.data.batches_per_epoch,
            "batch_size": t.run.data.batch_size,
            "world_size": t.info.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        t = self.trainer
        t.step = int(state["step"])
        t.position = int(state["position"])
        old = (int(state["world_size"]), int(state["batch_size"]), int(state["batches_per_epoch"]))
        new = (t.info.world_size, t.run.data.batch_size, t.data.batches_per_epoch)
        if old != new:
            # another data layout: keep the epoch, skip as many samples of it as were trained
            epoch, batch = divmod(t.position, old[2])
            batch = min(batch * old[0] * old[1] // (new[0] * new[1]), new[2])
            t.position = epoch * new[2] + batch
            if t.info.is_main:
                log.warning(
                    "resuming a checkpoint of %d rank(s) x %d batches/epoch on %d rank(s) x %d batches/epoch: the "
                    "data split differs, so training continues from the same epoch (%d) and share of samples "
                    "(batch %d), not bitwise as the original run would have",
                    old[0],
                    old[2],
                    new[0],
                    new[2],
                    epoch + 1,
                    batch,
                )


class _TrainingState:
    """`Stateful` view of everything the ranks share in a checkpoint: model (sharded tables and
    dense weights), both optimizers, LR scheduler and the loop's progress."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.progress = _Progress(trainer)

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {
            "model": t.state.model.state_dict(),
            "optim": t.optimizer.state_dict(),
            "progress": self.progress.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        t = self.trainer
        t.state.model.load_state_dict(state["model"])
        t.optimizer.load_state_dict(state["optim"])
        self.progress.load_state_dict(state["progress"])


class Trainer:
    """Builds everything from a validated RunConfig and its compiled plan (after the process
    group exists): data, model, optimizer with its schedule, streams, the training pipeline;
    the evaluation pipeline is derived from the same plan and streams when first needed.

    With a `run_dir`, rank 0 writes metrics there and every rank takes part in checkpoints
    (`trainer.checkpoint.*`). `restore(path)` loads a checkpoint before `fit()`. `data` is this
    rank's `RankData` if the caller built it already (the CLI does, to check it before the
    process group starts).
    """

    def __init__(
        self,
        run: RunConfig,
        plan: CompiledPlan,
        info: DistInfo,
        run_dir: str | None = None,
        data: RankData | None = None,
        stop: StopRequest | None = None,
        health: PeerHealth | None = None,
    ):
        self.run, self.plan, self.info, self.run_dir = run, plan, info, run_dir
        cfg = run.trainer
        from recsys_pipe.pp.config import data_replica  # the ranks of a pipeline read the same batches

        shard, shards = data_replica(run, info.rank, info.world_size)
        self.data = data or RankData(run.data, shard, shards, eval_batches=cfg.eval_batches)
        self.eval_loader = self.data.eval_loader()
        #: a retrieval source's own validation/test evaluation (None for other sources)
        self.retrieval = RetrievalEvaluation.of(self.data, info.world_size, cfg.eval_dump, info.is_main)
        self.spec = self.data.spec
        # python and numpy draw from OS entropy unless seeded; torch is seeded by build_model
        random.seed(run.seed)
        np.random.seed(run.seed)
        model, optimizer = build_model(run, info, self.spec)
        accumulate = cfg.grad_accumulation.steps
        self.optimizer = TrainOptimizer(optimizer, run.optimizer, -(-self.planned_steps // accumulate), model)
        self.state: TrainState = build_state(run, plan, model, self.optimizer, info)
        if cfg.grad_accumulation.enabled:
            self.state.grad_accumulation = GradAccumulation(cfg.grad_accumulation, model)
        self.pipeline = self._verified(build_pipeline(plan, self.state.streams, self.state))
        self._eval_pipeline: SchedulablePipeline | None = None  # built after the bootstrap
        #: training steps taken (over the whole run, across resumes): trained batches, so with
        #: gradient accumulation micro-steps (the optimizer steps every grad_accumulation.steps)
        self.step = 0
        #: the next training batch to train, counted across epochs
        self.position = 0
        self.metrics = MetricsWriter(run_dir if info.is_main else None, tensorboard=cfg.tensorboard)
        self.checkpointer = (
            Checkpointer(run_dir, cfg.checkpoint, info.checkpoint_group, info.rank) if run_dir is not None else None
        )
        if self.checkpointer is not None and info.is_main:
            self.checkpointer.on_published = lambda c: log.info("checkpoint step %d -> %s", c.step, c.path)
        #: SIGTERM handling (the CLI passes the one it installed for the whole process)
        self.stop = stop or StopRequest(info.control_group, cfg.preemption_check_s)
        #: heartbeats carry the step (set by the CLI for multi-rank runs)
        self.health = health

    @property
    def planned_steps(self) -> int:
        """Steps this configuration trains in all: `trainer.epochs` epochs, capped by `max_steps`."""
        cfg = self.run.trainer
        steps = cfg.epochs * self.data.batches_per_epoch
        return min(steps, cfg.max_steps) if cfg.max_steps is not None else steps

    # -- checkpoints ----------------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds in DCP (`Stateful`s): model, optimizers, schedule, progress.
        Each rank's RNG states (`RngState`) are saved next to it."""
        return {"train": _TrainingState(self)}

    def restore(self, path: str) -> None:
        """Continue from the checkpoint at `path`: weights, optimizer and schedule state, step,
        data position and (if the checkpoint has this rank's) RNG states."""
        self.optimizer.prepare_load()
        try:
            with_rng = load_checkpoint(
                path, self.checkpoint_state(), RngState(self.info.device), self.info.rank, self.info.checkpoint_group
            )
        except (RuntimeError, ValueError, KeyError) as exc:  # DCP's CheckpointException is a RuntimeError
            reason = str(exc).strip().splitlines()
            detail = next((line for line in reversed(reason) if "Error" in line), reason[0] if reason else "")
            raise ConfigError(
                ConfigProblem("trainer.resume_from", f"{path} does not fit this model and optimizer: {detail[:300]}")
            ) from exc
        if self.info.is_main:
            log.info(
                "resumed from %s: step %d, epoch %d, batch %d of the epoch%s",
                path,
                self.step,
                self.position // self.data.batches_per_epoch + 1,
                self.position % self.data.batches_per_epoch,
                "" if with_rng else " (the checkpoint has no RNG state of this rank: fresh RNG)",
            )

    def save_checkpoint(self, blocking: bool = False) -> None:
        assert self.checkpointer is not None
        self.checkpointer.save(self.step, self.checkpoint_state(), RngState(self.info.device), blocking=blocking)

    # -- loop -----------------------------------------------------------------------------------

    def fit(self, batches: Iterator | None = None, record_steps: bool = False) -> TrainSummary:
        """Train `trainer.epochs` epochs (capped by `trainer.max_steps`) from the current
        position; evaluate every `trainer.eval_every` steps, at the end of every
        `trainer.eval_epochs`-th epoch, before the first step and after the last; checkpoint
        every `trainer.checkpoint.interval` steps, at the end, and when a SIGTERM asks to stop
        (then on every rank after the same step).

        The loss is read back to the host only at log steps (and, with `record_steps`, every
        step): reading it every step would make the host wait for the device each iteration
        and undo the pipelining on CUDA. `batches` replaces the training data by any iterator
        (one pass, no epochs).
        """
        cfg = self.run.trainer
        per_epoch = self.data.batches_per_epoch if batches is None else None
        summary = TrainSummary(start_step=self.step)
        if cfg.max_steps is not None and self.step >= cfg.max_steps:
            summary.stop_reason = MAX_STEPS
        elif batches is None and self.position >= cfg.epochs * self.data.batches_per_epoch:
            summary.stop_reason = EPOCHS_DONE
        if summary.stop_reason:  # e.g. resumed from the last checkpoint of a finished run
            if self.info.is_main:
                log.warning("nothing to train: at step %d, %s already", self.step, summary.stop_reason)
            return summary
        self._warn_if_data_ends_first()
        it = iter(self.data.train_loader(cfg.epochs, self.position)) if batches is None else batches
        try:
            first = next(it)
        except StopIteration:
            summary.stop_reason = DATA_EXHAUSTED
            log.warning("the training data yielded no batch")
            return summary
        self.pipeline.seed_first_batch(it, self.state.bootstrap(first))
        accumulation = self.state.grad_accumulation
        if accumulation is not None:  # micro-steps are counted over the run; the pipeline counts from 0
            accumulation.start_step = self.step
            accumulation.last_step = self.planned_steps - 1 if batches is None else None
        evaluating = (self.eval_loader is not None or self.retrieval is not None) and cfg.eval_every > 0
        last_eval = last_checkpoint = None
        if evaluating and self.step == 0:
            summary.evals.append(self._log_eval(0, record_steps))
            last_eval = 0
        bar = tqdm(
            total=self.planned_steps,
            initial=self.step,
            desc="train",
            unit="step",
            # a log file gets the plain `step N | ...` lines only, not the bar's \r updates
            disable=not self.info.is_main or not cfg.progress_bar or not sys.stderr.isatty(),
            dynamic_ncols=True,
        )
        window_start, window_samples = time.perf_counter(), 0
        traced = StepWindow(cfg.torch_profiler.steps, self.run_dir or ".", self.info.rank, self.pipeline)
        traced.step(self.step)
        start = time.perf_counter()
        with self.stop, logging_redirect_tqdm():
            result: StepResult
            for result in self.pipeline.iterate(it):
                self.step += 1
                self.position += 1
                traced.step(self.step)
                summary.steps += 1
                if self.health is not None:
                    self.health.step = self.step
                samples = result.num_samples * self.info.world_size // self.run.parallel.pp.size  # replicas
                summary.samples += samples
                window_samples += samples
                if record_steps:
                    summary.losses.append(float(result.loss))
                    summary.sample_ids.append(result.sample_ids.cpu())
                if summary.steps == 1:
                    summary.first_loss = float(result.loss)
                last = result
                bar.update(1)
                if self.step % cfg.log_every == 0:
                    now = time.perf_counter()
                    loss = self._log_step(result, window_samples / (now - window_start))
                    bar.set_postfix(loss=f"{loss:.4f}")
                    window_start, window_samples = now, 0
                epoch_end = per_epoch is not None and self.position % per_epoch == 0
                if epoch_end and self.info.is_main:
                    log.info("epoch %d/%d done at step %d", self.position // per_epoch, cfg.epochs, self.step)
                epoch_eval = epoch_end and cfg.eval_epochs > 0 and (self.position // per_epoch) % cfg.eval_epochs == 0
                if evaluating and (epoch_eval or self.step % cfg.eval_every == 0):
                    summary.evals.append(self._log_eval(self.step, record_steps))
                    last_eval = self.step
                stop = self.stop.should_stop()
                if self.checkpointer is not None:
                    self.checkpointer.poll()
                    if stop or self.checkpointer.due(self.step):
                        self.save_checkpoint(blocking=stop)
                        last_checkpoint = self.step
                if stop:
                    summary.stop_reason = PREEMPTED
                    log.warning(
                        "%s received: stopped after step %d on every rank%s",
                        self.stop.signal_name or "stop request",
                        self.step,
                        f"; checkpoint {self.checkpointer.last.path}" if self.checkpointer else " (no run dir)",
                    )
                    break
                if cfg.max_steps is not None and self.step >= cfg.max_steps:
                    summary.stop_reason = MAX_STEPS
                    break
            else:
                summary.stop_reason = EPOCHS_DONE if per_epoch else DATA_EXHAUSTED
            self.stop.drain()
        if accumulation is not None and summary.stop_reason != PREEMPTED and accumulation.pending(self.step):
            # training ended inside a window: step what was accumulated (torchrec's flush)
            self.optimizer.step()
            self.optimizer.zero_grad()
        summary.seconds = time.perf_counter() - start
        traced.close()
        if summary.steps:
            summary.last_loss = float(last.loss)
        bar.close()
        if summary.stop_reason != PREEMPTED:
            if evaluating and last_eval != self.step:
                summary.evals.append(self._log_eval(self.step, record_steps))
            if self.checkpointer is not None and self.checkpointer.cfg.interval and last_checkpoint != self.step:
                self.save_checkpoint()
            self._log_stop(summary)
        if self.checkpointer is not None:
            self.checkpointer.wait()
            summary.checkpoint = str(self.checkpointer.last.path) if self.checkpointer.last else None
        return summary

    def evaluate(self, record_batches: bool = False) -> dict[str, Any]:
        """Loss, log loss (binary cross-entropy per scored row and task) and per-task AUC over the
        held-out loader, aggregated over all ranks; for a retrieval source, its ranking metrics
        (`RetrievalEvaluation`). With `record_batches`, also this rank's
        evaluated batches in order: `sample_ids` and `batch_losses` (which batch each output
        belongs to, for the checks that switching to evaluation mislabels nothing)."""
        if self._eval_pipeline is None:  # same plan and streams, its own executor threads
            self._eval_pipeline = self._verified(build_pipeline(self.plan, self.state.streams, self.state.for_eval()))
        self.state.model.train(False)
        if self.retrieval is not None:
            try:
                return self.retrieval.evaluate(self._eval_pipeline)
            finally:
                self.state.model.train(True)
        assert self.eval_loader is not None
        num_tasks = self.spec.num_tasks
        aurocs = [BinaryAUROC().to(self.info.device) for _ in range(num_tasks)]  # any task count, 1 included
        mean_loss = MeanMetric().to(self.info.device)
        log_loss = MeanMetric().to(self.info.device)
        sample_ids: list[list[int]] = []
        batch_losses: list[float] = []
        try:
            for result in self._eval_pipeline.iterate(self.eval_loader):
                if record_batches:
                    sample_ids.append(result.sample_ids.tolist())
                    batch_losses.append(float(result.loss))
                logits = result.logits.float()  # bf16 under trainer.precision=bf16
                for task, auroc in enumerate(aurocs):
                    auroc.update(logits[:, task], result.labels[:, task].int())
                mean_loss.update(result.loss.float())
                log_loss.update(F.binary_cross_entropy_with_logits(logits, result.labels, reduction="none"))
            per_task = [float(auroc.compute()) for auroc in aurocs]
            metrics = {
                "eval_loss": float(mean_loss.compute()),
                "log_loss": float(log_loss.compute()),
                "auc": sum(per_task) / num_tasks,
                "auc_per_task": [round(a, 5) for a in per_task],
            }
            if record_batches:
                metrics.update(sample_ids=sample_ids, batch_losses=batch_losses)
            return metrics
        finally:
            self.state.model.train(True)

    def close(self) -> None:
        self.pipeline.shutdown()
        if self._eval_pipeline is not None:
            self._eval_pipeline.shutdown()
        self.state.close()
        self.metrics.close()

    # -- helpers --------------------------------------------------------------------------------

    def _verified(self, pipeline: SchedulablePipeline) -> SchedulablePipeline:
        """`pipeline` under `trainer.verify_collectives` (see `recsys_pipe.runtime.verify`)."""
        mode = self.run.trainer.verify_collectives
        if mode != "off":  # startup: long enough for every task to run in prefill and steady state
            CollectiveGuard(pipeline, None if mode == "always" else self.plan.graph.max_lookahead + 2)
        return pipeline

    def _warn_if_data_ends_first(self) -> None:
        cfg = self.run.trainer
        available = cfg.epochs * self.data.batches_per_epoch
        if self.info.is_main and cfg.max_steps is not None and cfg.max_steps > available:
            log.warning(
                "trainer.max_steps=%d exceeds trainer.epochs=%d x %d batches per epoch: training stops after step %d; "
                "raise trainer.epochs to train longer",
                cfg.max_steps,
                cfg.epochs,
                self.data.batches_per_epoch,
                available,
            )

    def _log_stop(self, summary: TrainSummary) -> None:
        cfg = self.run.trainer
        if not self.info.is_main:
            return
        detail = {
            MAX_STEPS: f"trainer.max_steps={cfg.max_steps}",
            EPOCHS_DONE: f"{cfg.epochs} epoch(s) of {self.data.batches_per_epoch} batches",
            DATA_EXHAUSTED: "the batch iterator ended",
        }[summary.stop_reason]
        log.info("training stopped at step %d: %s (%s)", self.step, summary.stop_reason, detail)
        if summary.stop_reason != MAX_STEPS and cfg.max_steps is not None and self.step < cfg.max_steps:
            log.warning("the data ran out at step %d, before trainer.max_steps=%d", self.step, cfg.max_steps)

    def _log_step(self, result: StepResult, samples_per_s: float) -> float:
        """Metrics record and console summary of a log step; returns the loss (mean over ranks)."""
        loss = self._global_mean(result.loss)
        record: dict[str, Any] = {
            "step": self.step,
            "loss": loss,
            "samples_per_s": round(samples_per_s, 2),
            "lr": self.optimizer.last_lr,
        }
        if self.optimizer.last_grad_norm is not None:
            record["grad_norm"] = float(self.optimizer.last_grad_norm)
        record["mem_gib"] = round(_memory_gib(self.info.device), 3)
        self.metrics.write(record)
        if self.info.is_main:
            per_epoch = self.data.batches_per_epoch
            log.info(
                "step %d | epoch %d | loss %.4f | %.0f samples/s | lr %.3g | mem %.2f GiB",
                self.step,
                (self.position - 1) // per_epoch + 1,
                loss,
                samples_per_s,
                record["lr"],
                record["mem_gib"],
            )
        return loss

    def _log_eval(self, step: int, record_batches: bool = False) -> dict[str, Any]:
        metrics = {"step": step, **self.evaluate(record_batches)}
        self.metrics.write({k: v for k, v in metrics.items() if k not in ("sample_ids", "batch_losses")})
        if self.info.is_main and self.retrieval is not None:
            log.info("eval at step %d: %s", step, self.retrieval.describe(metrics))
        elif self.info.is_main:
            log.info("eval at step %d: loss %.4f, auc %.4f", step, metrics["eval_loss"], metrics["auc"])
        return metrics

    def _global_mean(self, value: torch.Tensor) -> float:
        replica_mean = getattr(self.state.model, "replica_mean", None)  # pipelined: over the replicas
        if replica_mean is not None:
            return replica_mean(value)
        value = value.detach().float().reshape(1).clone()
        if self.info.world_size > 1:
            dist.all_reduce(value)
            value /= self.info.world_size
        return float(value)


def _memory_gib(device: torch.device) -> float:
    """Peak memory of this rank: allocated device memory on CUDA, resident host memory else."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
