"""The training loop: one plan runner for training, one for evaluation, same model.

A `Trainer` is a loop over finished parts (`recsys_pipe.train.build.build_parts`): the data, the
training plan runner, and the parts that decide themselves when they act -- the evaluator
(`Evaluator.due`), the checkpointer (`RunCheckpointer.save_if_due`) and the reporter
(`Reporter.step`: log lines, progress bar, metrics). `Trainer.fit` is the loop, `train_step` one
step; what remains here is when the loop starts and why it stops.

Evaluation runs through its own plan runner (same plan, optimizer work switched off) over the
held-out loader, so the training plan runner keeps its in-flight batches across an evaluation:
no training batch is dropped or replayed, and no training batch leaks into evaluation.

Epochs are one continuous stream of batches (`RankData.train_loader(epochs, start)`): the
plan runner never drains or restarts at an epoch boundary, it just keeps pulling; the loop notices
an epoch end by counting trained batches. Checkpoints store the position of the next batch to
*train*: batches already pulled, moved or input-distributed for later steps are simply pulled
again from that position by a resumed run, which refills the ring exactly as the uninterrupted
run had it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from tqdm.contrib.logging import logging_redirect_tqdm

from recsys_pipe.runtime.health import PeerHealth
from recsys_pipe.runtime.preemption import StopRequest
from recsys_pipe.train.build import TrainParts
from recsys_pipe.train.progress import DATA_EXHAUSTED, EPOCHS_DONE, MAX_STEPS, PREEMPTED, TrainSummary
from recsys_pipe.train.resume import EVAL_BEST_KEY
from recsys_pipe.train.retrieval_eval import RetrievalEvaluation
from recsys_pipe.train.tasks import StepResult
from recsys_pipe.train.torch_compile import compile_failures
from recsys_pipe.train.torch_profile import StepWindow

__all__ = [
    "DATA_EXHAUSTED",
    "EPOCHS_DONE",
    "EVAL_BEST_KEY",
    "MAX_STEPS",
    "PREEMPTED",
    "Trainer",
    "TrainSummary",
]

log = logging.getLogger(__name__)


class Trainer:
    """The training loop of a run over its finished parts (`build_parts`).

    `stop` is the SIGTERM agreement (the CLI passes the one its session installed; by default
    one of its own), `health` the peer watch whose heartbeats carry the step (multi-rank runs
    started by the CLI). `restore(path)` loads a checkpoint before `fit()`.
    """

    def __init__(self, parts: TrainParts, stop: StopRequest | None = None, health: PeerHealth | None = None):
        self.parts = parts
        self.run, self.plan, self.info, self.run_dir = parts.run, parts.plan, parts.info, parts.run_dir
        self.data, self.state, self.optimizer = parts.data, parts.state, parts.optimizer
        self.plan_runner, self.evaluator = parts.plan_runner, parts.evaluator
        self.checkpointer, self.reporter, self.position = parts.checkpointer, parts.reporter, parts.position
        self.stop = stop or StopRequest(self.info.control_group, self.run.trainer.preemption_check_s)
        self._skipped: Any = None
        self.health = health

    @property
    def step(self) -> int:
        """Training steps taken over the whole run, across resumes (`RunPosition.step`)."""
        return self.position.step

    @property
    def planned_steps(self) -> int:
        """Steps this configuration trains in all: `trainer.epochs` epochs, capped by `max_steps`."""
        return self.parts.planned_steps

    @property
    def retrieval(self) -> RetrievalEvaluation | None:
        """A retrieval source's own validation/test evaluation (None for other sources)."""
        return self.evaluator.retrieval

    def restore(self, path: str) -> None:
        """Continue from the checkpoint at `path` (`RunCheckpointer.restore`)."""
        self.checkpointer.restore(path)

    def evaluate(self, record_batches: bool = False) -> dict[str, Any]:
        """The model's metrics on held-out data at the current step (`Evaluator.evaluate_at`)."""
        return self.evaluator.evaluate_at(self.step, record_batches)

    def close(self) -> None:
        """Shut down the plan runners' worker threads, the state's resources and the metrics writer."""
        self.parts.close()

    def fit(self, batches: Iterator | None = None, record_steps: bool = False) -> TrainSummary:
        """Train `trainer.epochs` epochs (capped by `trainer.max_steps`) from the current
        position; evaluate when the evaluator is due, before the first step and after the last;
        checkpoint when the checkpointer is due, at the end, and when a SIGTERM asks to stop
        (then on every rank after the same step).

        `batches` replaces the training data by any iterator (one pass, no epochs). With
        `record_steps`, every step's loss and sample ids are kept (parity checks). Under
        `trainer.compile=true`, a torch.compile failure is a ConfigError naming the key
        (`compile_failures`).
        """
        with compile_failures(self.parts.compiled):
            return self._fit(batches, record_steps)

    def train_step(self, results: Iterator[StepResult]) -> StepResult | None:
        """One training step: the plan runner trains the next batch (running this iteration's tasks,
        those of batches ahead included) and hands back its result; None once the data ended."""
        result = next(results, None)
        if result is not None:
            self.position.step += 1
            self.position.batch += 1
            if self._skipped:  # the bad rows its source left out of the batch just trained
                epoch = (self.position.batch - 1) // self.data.batches_per_epoch + 1
                self.position.skipped[epoch] += self._skipped.popleft()
            if self.health is not None:
                self.health.step = self.step
        return result

    def _fit(self, batches: Iterator | None, record_steps: bool) -> TrainSummary:
        summary = TrainSummary(start_step=self.step, stop_reason=self._nothing_to_train(batches is None))
        if summary.stop_reason:
            return summary
        self.reporter.warn_if_data_ends_first()
        results = self._start(batches)
        if results is None:
            summary.stop_reason = DATA_EXHAUSTED
            return summary
        per_epoch = None if batches is not None else self.data.batches_per_epoch
        compile_start = self.parts.compiled.stats() if self.parts.compiled is not None else None
        traced = StepWindow(
            self.run.trainer.torch_profiler.steps, self.run_dir or ".", self.info.rank, self.plan_runner
        )
        traced.step(self.step)
        self.reporter.start(self.planned_steps)
        if self.evaluator.enabled and self.step == 0:
            self._evaluate(summary, record_steps)
        last, stopping = None, False
        start = time.perf_counter()
        with self.stop, logging_redirect_tqdm():
            while not summary.stop_reason:
                result = self.train_step(results)
                if result is None:  # the data ended
                    summary.stop_reason = EPOCHS_DONE if per_epoch else DATA_EXHAUSTED
                    break
                traced.step(self.step)
                self.reporter.step(summary, result, record_steps, per_epoch)
                last = result
                epoch_end = per_epoch is not None and self.position.batch % per_epoch == 0
                if self.evaluator.due(self.step, self.position.batch // per_epoch if epoch_end else None):
                    self._evaluate(summary, record_steps)
                stopping = stopping or self._stop_requested()
                summary.stop_reason = self._stop_reason(stopping)
                self.checkpointer.save_if_due(self.step, preempted=summary.stop_reason == PREEMPTED)
                if summary.stop_reason == PREEMPTED:
                    self._log_preempted()
            self.stop.drain()
        self._flush_accumulation(summary)
        summary.seconds = time.perf_counter() - start
        if compile_start is not None:
            summary.compiled = self.parts.compiled.stats().since(compile_start)  # type: ignore[union-attr]
        traced.close()
        self.reporter.end(summary, last)
        summary.skipped = self.reporter.skipped_rows()
        if summary.stop_reason != PREEMPTED:
            if self.evaluator.enabled and (not summary.evals or summary.evals[-1]["step"] != self.step):
                self._evaluate(summary, record_steps)
            self.checkpointer.finish(self.step)
            self.reporter.stopped(summary)
        self.checkpointer.wait()
        summary.checkpoint = self.checkpointer.last_path
        return summary

    def _evaluate(self, summary: TrainSummary, record_batches: bool) -> None:
        summary.evals.append(self.reporter.evaluation(self.step, self.evaluate(record_batches)))

    def _nothing_to_train(self, epochs: bool) -> str:
        """The stop reason if the run is already done (e.g. resumed from the last checkpoint of a
        finished run), else ''."""
        cfg = self.run.trainer
        per_epoch = self.data.batches_per_epoch
        if cfg.max_steps is not None and self.step >= cfg.max_steps:
            reason, detail = MAX_STEPS, f"step {self.step} >= trainer.max_steps={cfg.max_steps}"
        elif epochs and self.position.batch >= cfg.epochs * per_epoch:
            reason = EPOCHS_DONE
            detail = f"batch {self.position.batch} >= trainer.epochs={cfg.epochs} x {per_epoch} batches"
        else:
            return ""
        if self.info.is_main:
            log.warning("nothing to train: %s (raise it to train on)", detail)
        return reason

    def _start(self, batches: Iterator | None) -> Iterator[StepResult] | None:
        """Seed the training plan runner with the first batch (`TrainState.bootstrap`) and return its
        results; None if there is no batch to train."""
        loader = self.data.train_loader(self.run.trainer.epochs, self.position.batch) if batches is None else None
        it = iter(loader) if loader is not None else batches
        #: a streaming source's count of skipped rows per batch made (`data.on_bad_row=skip`)
        self._skipped = getattr(loader, "skipped", None)
        try:
            first = next(it)
        except StopIteration:
            log.warning("the training data yielded no batch")
            return None
        self.plan_runner.seed_first_batch(it, self.state.bootstrap(first))
        self.state.start_step = self.step
        accumulation = self.state.grad_accumulation
        if accumulation is not None:  # micro-steps are counted over the run; the plan runner counts from 0
            accumulation.start(self.step, self.planned_steps - 1 if batches is None else None)
        return self.plan_runner.iterate(it)

    def _stop_requested(self) -> bool:
        """Whether every rank agreed to stop (SIGTERM) after this step. A stop inside a gradient
        accumulation window waits for the window's optimizer step: the checkpoint then loses no
        accumulated gradient (they are not part of it)."""
        if not self.stop.should_stop():
            return False
        if self._inside_window() and self.info.is_main:
            window = self.state.grad_accumulation.steps  # type: ignore[union-attr]
            log.warning(
                "%s received inside a gradient accumulation window: training on to step %d, the window's "
                "optimizer step, before stopping",
                self.stop.signal_name or "stop request",
                -(-self.step // window) * window,
            )
        return True

    def _stop_reason(self, stopping: bool) -> str:
        """Why training stops after this step ('' to go on): an agreed stop request once outside
        an accumulation window, or `trainer.max_steps`."""
        if stopping and not self._inside_window():
            return PREEMPTED
        max_steps = self.run.trainer.max_steps
        return MAX_STEPS if max_steps is not None and self.step >= max_steps else ""

    def _inside_window(self) -> bool:
        """Whether gradients accumulated so far wait for an optimizer step."""
        accumulation = self.state.grad_accumulation
        return accumulation is not None and accumulation.pending(self.step)

    def _log_preempted(self) -> None:
        saved = " (no run dir)" if self.checkpointer.writer is None else f"; checkpoint {self.checkpointer.last_path}"
        signal = self.stop.signal_name or "stop request"
        log.warning("%s received: stopped after step %d on every rank%s", signal, self.step, saved)

    def _flush_accumulation(self, summary: TrainSummary) -> None:
        """Training ended inside an accumulation window: step what was accumulated (torchrec's flush)."""
        if summary.stop_reason != PREEMPTED and self._inside_window():
            self.optimizer.step()
            self.optimizer.zero_grad()
