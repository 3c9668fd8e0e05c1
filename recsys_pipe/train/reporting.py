"""What a training run reports while it trains: the log lines of log steps, evaluations, epochs
and the stop, the progress bar, and the records of `metrics.jsonl` and TensorBoard
(`MetricsWriter`).

`Reporter` is a finished part of a run (`recsys_pipe.train.build.build_parts`): the loop hands it
each step's result (`step`), and it decides itself when a log line is due (`due(step)`, every
`trainer.log_every` steps). The loss of a log step is read back to the host there and only
there: reading it every step would make the host wait for the device each iteration and undo
the overlap of a plan's lookaheads on CUDA.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from recsys_pipe.runtime.distributed import DistInfo
from recsys_pipe.train.config import TrainerConfig
from recsys_pipe.train.metrics import MetricsWriter
from recsys_pipe.train.optim import TrainOptimizer
from recsys_pipe.train.progress import DATA_EXHAUSTED, EPOCHS_DONE, MAX_STEPS, RunPosition, TrainSummary
from recsys_pipe.train.retrieval_eval import RetrievalEvaluation
from recsys_pipe.train.tasks import StepResult
from recsys_pipe.train.torch_compile import CompiledDense, CompileStats

__all__ = ["Reporter"]

log = logging.getLogger(__name__)


class Reporter:
    """Log lines, progress bar and metrics records of a run (rank 0 writes; every rank takes
    part in the collective of a log step's loss).

    Args:
        cfg: `trainer.*` (log_every, progress_bar, epochs, max_steps).
        info: this rank's place in the job.
        metrics: the metrics writer (a no-op on ranks other than 0).
        optimizer: its last learning rate and gradient norm go into the records.
        position: the loop's position (the epoch of a log line).
        batches_per_epoch: this rank's training batches per epoch.
        global_mean: a step's loss averaged over the data-parallel replicas (the model's
            distribution decides what a replica is: `recsys_pipe.train.distribution`).
        replicas: data-parallel replicas: a step trains `replicas` x a rank's samples.
        retrieval: a retrieval source's evaluation (it words its own evaluation line), or None.
        compiled: torch.compile's state (`trainer.compile=true`), None in eager mode.
        skipping: whether the source skips bad rows (`data.on_bad_row=skip`): log steps and the
            end then count them over the replicas (`position.skipped`).
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        info: DistInfo,
        metrics: MetricsWriter,
        optimizer: TrainOptimizer,
        position: RunPosition,
        batches_per_epoch: int,
        global_mean: Callable[[torch.Tensor], float],
        replicas: int,
        retrieval: RetrievalEvaluation | None = None,
        compiled: CompiledDense | None = None,
        skipping: bool = False,
    ):
        self.skipping = skipping
        self.cfg, self.info, self.metrics, self.optimizer = cfg, info, metrics, optimizer
        self.position, self.batches_per_epoch = position, batches_per_epoch
        self.global_mean, self.replicas = global_mean, replicas
        self.retrieval, self.compiled = retrieval, compiled
        self._bar: tqdm | None = None
        self._window_start = time.perf_counter()
        self._window_samples = 0
        #: torch.compile's counts at the last log step: its seconds since then are left out of
        #: the window's samples/s
        self._compile_stats = CompileStats()

    # -- one fit ----------------------------------------------------------------------------------

    def start(self, planned_steps: int) -> None:
        """A fit begins at the current position: the progress bar, a fresh throughput window."""
        self._bar = tqdm(
            total=planned_steps,
            initial=self.position.step,
            desc="train",
            unit="step",
            # a log file gets the plain `step N | ...` lines only, not the bar's \r updates
            disable=not self.info.is_main or not self.cfg.progress_bar or not sys.stderr.isatty(),
            dynamic_ncols=True,
        )
        self._window_start, self._window_samples = time.perf_counter(), 0
        if self.compiled is not None:  # counts of an earlier fit are not this one's
            self._compile_stats = self.compiled.stats()

    def step(self, summary: TrainSummary, result: StepResult, record: bool, per_epoch: int | None) -> None:
        """After each step: count its samples, keep its loss where asked (`record`), and write
        the log line when due and the end of an epoch (`per_epoch`: None without epochs)."""
        samples = result.num_samples * self.replicas
        summary.steps += 1
        summary.samples += samples
        self._window_samples += samples
        if record:
            summary.losses.append(float(result.loss))
            summary.sample_ids.append(result.sample_ids.cpu())
        if summary.steps == 1:
            summary.first_loss = float(result.loss)
        assert self._bar is not None
        self._bar.update(1)
        step = self.position.step
        if self.due(step):
            self._log_step(result)
        if per_epoch is not None and self.position.batch % per_epoch == 0:
            epoch = self.position.batch // per_epoch
            skipped = self.skipped_rows()  # every rank: a collective when skipping
            if self.info.is_main:
                bad = f" ({skipped['per_epoch'].get(epoch, 0)} bad row(s) skipped)" if skipped else ""
                log.info("epoch %d/%d done at step %d%s", epoch, self.cfg.epochs, step, bad)

    def skipped_rows(self) -> dict[str, Any] | None:
        """The bad rows skipped so far over every replica, `{"total": n, "per_epoch": {epoch: n}}`
        (a collective on every rank); None when the source does not skip (`data.on_bad_row=fail`)."""
        if not self.skipping:
            return None
        epochs = sorted(set(self.position.skipped) | {(max(self.position.batch, 1) - 1) // self.batches_per_epoch + 1})
        counts = torch.tensor([float(self.position.skipped[e]) for e in epochs])
        totals = [round(self.global_mean(c) * self.replicas) for c in counts]
        per_epoch = {e: n for e, n in zip(epochs, totals) if n}
        return {"total": sum(totals), "per_epoch": per_epoch}

    def due(self, step: int) -> bool:
        """Whether `step` is a log step (every `trainer.log_every` steps)."""
        return step % self.cfg.log_every == 0

    def evaluation(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record and log an evaluation's metrics at `step`; returns them with their step."""
        metrics = {"step": step, **metrics}
        self.metrics.write({k: v for k, v in metrics.items() if k not in ("sample_ids", "batch_losses")})
        if self.info.is_main and self.retrieval is not None:
            log.info("eval at step %d: %s", step, self.retrieval.describe(metrics))
        elif self.info.is_main:
            log.info("eval at step %d: loss %.4f, auc %.4f", step, metrics["eval_loss"], metrics["auc"])
        return metrics

    def end(self, summary: TrainSummary, last: StepResult | None) -> None:
        """The fit's last loss; the bar closes."""
        if last is not None:
            summary.last_loss = float(last.loss)
        if self._bar is not None:
            self._bar.close()

    def stopped(self, summary: TrainSummary) -> None:
        """The line saying why training stopped (not for a preemption, which says its own)."""
        cfg, step = self.cfg, self.position.step
        if not self.info.is_main:
            return
        detail = {
            MAX_STEPS: f"trainer.max_steps={cfg.max_steps}",
            EPOCHS_DONE: f"{cfg.epochs} epoch(s) of {self.batches_per_epoch} batches",
            DATA_EXHAUSTED: "the batch iterator ended",
        }[summary.stop_reason]
        log.info("training stopped at step %d: %s (%s)", step, summary.stop_reason, detail)
        if summary.stop_reason != MAX_STEPS and cfg.max_steps is not None and step < cfg.max_steps:
            log.warning("the data ran out at step %d, before trainer.max_steps=%d", step, cfg.max_steps)

    def warn_if_data_ends_first(self) -> None:
        """`trainer.max_steps` beyond the epochs' batches: say where training will stop."""
        cfg = self.cfg
        available = cfg.epochs * self.batches_per_epoch
        if self.info.is_main and cfg.max_steps is not None and cfg.max_steps > available:
            log.warning(
                "trainer.max_steps=%d exceeds trainer.epochs=%d x %d batches per epoch: training stops after step %d; "
                "raise trainer.epochs to train longer",
                cfg.max_steps,
                cfg.epochs,
                self.batches_per_epoch,
                available,
            )

    def close(self) -> None:
        """Close the metrics writer (safe to call twice)."""
        self.metrics.close()

    # -- log steps --------------------------------------------------------------------------------

    def _log_step(self, result: StepResult) -> None:
        now = time.perf_counter()
        compiled = self._compile_stats_now()
        seconds = now - self._window_start - (compiled.seconds - self._compile_stats.seconds if compiled else 0.0)
        loss = self._record_step(result, self._window_samples / max(seconds, 1e-9), compiled)
        self._compile_stats = compiled or self._compile_stats
        assert self._bar is not None
        self._bar.set_postfix(loss=f"{loss:.4f}")
        self._window_start, self._window_samples = now, 0

    def _compile_stats_now(self) -> CompileStats | None:
        """torch.compile's counts now (None in eager mode); a line in the log when they changed
        since the last log step."""
        if self.compiled is None:
            return None
        stats = self.compiled.stats()
        if stats != self._compile_stats and self.info.is_main:
            log.info("step %d | %s", self.position.step, stats.describe())
        return stats

    def _record_step(self, result: StepResult, samples_per_s: float, compiled: CompileStats | None) -> float:
        """Metrics record and console summary of a log step; returns the loss (mean over
        replicas). With `compiled`, the record carries torch.compile's counts (`CompileStats.record`)."""
        loss = self.global_mean(result.loss)
        step = self.position.step
        record: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "samples_per_s": round(samples_per_s, 2),
            "lr": self.optimizer.last_lr,
        }
        if self.optimizer.last_grad_norm is not None:
            record["grad_norm"] = float(self.optimizer.last_grad_norm)
        record["mem_gib"] = round(_memory_gib(self.info.device), 3)
        if compiled is not None:
            record.update(compiled.record())
        epoch = (self.position.batch - 1) // self.batches_per_epoch + 1
        skipped = self.skipped_rows()
        bad = ""
        if skipped is not None:
            record["skipped_rows"] = skipped["total"]
            record["skipped_rows_epoch"] = skipped["per_epoch"].get(epoch, 0)
            bad = f" | skipped {record['skipped_rows_epoch']} bad row(s) this epoch, {skipped['total']} in all"
        self.metrics.write(record)
        if self.info.is_main:
            log.info(
                "step %d | epoch %d | loss %.4f | %.0f samples/s | lr %.3g | mem %.2f GiB%s",
                step,
                epoch,
                loss,
                samples_per_s,
                record["lr"],
                record["mem_gib"],
                bad,
            )
        return loss


def _memory_gib(device: torch.device) -> float:
    """Peak memory of this rank: allocated device memory on CUDA, resident host memory else."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
