"""The training loop: one plan-driven pipeline for training, one for evaluation, same model.

The parts are built once, before the loop (`recsys_pipe.train.build.build_parts`); `Trainer.fit`
is the loop, `Trainer.train_step` one step, and named helpers log, evaluate, checkpoint and
decide when to stop.

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
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem
from recsys_pipe.data import RankData
from recsys_pipe.runtime.distributed import DistInfo
from recsys_pipe.runtime.health import PeerHealth
from recsys_pipe.runtime.preemption import StopRequest
from recsys_pipe.train.build import TrainParts, build_parts
from recsys_pipe.train.checkpoint import load_checkpoint, read_metadata, saved_config
from recsys_pipe.train.config import RunConfig
from recsys_pipe.train.retrieval_eval import RetrievalEvaluation
from recsys_pipe.train.tasks import StepResult
from recsys_pipe.train.torch_compile import CompileStats, compile_failures
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
    #: what torch.compile did during this fit (`trainer.compile=true`), else None
    compiled: CompileStats | None = None

    @property
    def end_step(self) -> int:
        """The step the run stands at after this `fit` (a resumed run starts above 0)."""
        return self.start_step + self.steps

    @property
    def samples_per_s(self) -> float:
        """Training throughput of this `fit`: samples over its wall-clock seconds, torch.compile's
        own seconds left out as the step lines leave them out (0 if none)."""
        seconds = self.seconds - (self.compiled.seconds if self.compiled is not None else 0.0)
        return self.samples / seconds if seconds > 0 else 0.0

    def describe(self) -> str:
        """One line for the log: steps, samples, speed, loss and eval AUC from first to last."""
        if not self.steps:
            return f"trained nothing: at step {self.start_step}, {self.stop_reason or 'no batch'}"
        evals = ""
        if self.evals and "auc" in self.evals[-1]:  # retrieval evaluations log their own line
            evals = f"; eval auc {self.evals[0]['auc']:.4f} -> {self.evals[-1]['auc']:.4f}"
        return (
            f"trained {self.steps} steps ({self.start_step} -> {self.end_step}), {self.samples} samples, "
            f"{self.samples_per_s:.1f} samples/s; loss {self.first_loss or float('nan'):.4f} -> "
            f"{self.last_loss or float('nan'):.4f}{evals}{self._compiled()}"
        )

    def _compiled(self) -> str:
        if self.compiled is None:
            return ""
        c = self.compiled
        return (
            f"; torch.compile: {c.seconds:.1f} s compiling (left out of samples/s), {c.graphs} graphs, "
            f"{c.graph_breaks} graph breaks, "
            f"{c.recompiles} recompiles"
        )


#: DCP key of a retrieval run's best validation score so far (`_Progress`)
EVAL_BEST_KEY = "train.progress.eval_best"


class _Progress:
    """The checkpointed part of the loop itself: step, data position and the run's data layout
    (so a resume on another world size can map the position onto its own batches), and for a
    retrieval run the best validation score so far, so that a resumed run's `eval_dump` still
    holds the evaluation validation picks over the whole run. `eval_best=False` leaves that out
    (loading a checkpoint written before it was saved)."""

    def __init__(self, trainer: Trainer, eval_best: bool = True):
        self.trainer = trainer
        self.eval_best = eval_best and trainer.retrieval is not None

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        state = {
            "step": t.step,
            "position": t.position,
            "batches_per_epoch": t.data.batches_per_epoch,
            "batch_size": t.run.data.batch_size,
            "world_size": t.info.world_size,
        }
        if self.eval_best:
            assert t.retrieval is not None
            state["eval_best"] = float("-inf") if t.retrieval.best is None else t.retrieval.best
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        t = self.trainer
        t.step = int(state["step"])
        t.position = int(state["position"])
        if self.eval_best and t.retrieval is not None:
            best = float(state["eval_best"])
            t.retrieval.best = None if best == float("-inf") else best
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

    def __init__(self, trainer: Trainer, eval_best: bool = True):
        self.trainer = trainer
        self.progress = _Progress(trainer, eval_best)

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


#: the key of `TrainState.in_flight` in a rank's own checkpoint file, next to its RNG states
IN_FLIGHT_KEY = "in_flight"


class _RankState:
    """`Stateful` of what a checkpoint holds for one rank only: its RNG states (`RngState`) and
    what is in flight (`TrainState.in_flight`: a semi-synchronous plan's started lookups and
    kept gradients, absent otherwise). `lookups_restored` says whether the loaded file had
    lookups in flight."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.lookups_restored = False

    def state_dict(self) -> dict[str, Any]:
        state = self.trainer.rng.state_dict()
        in_flight = self.trainer.state.in_flight()
        if in_flight:
            state[IN_FLIGHT_KEY] = in_flight
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.rng.load_state_dict(state)
        in_flight = state.get(IN_FLIGHT_KEY, {})
        self.trainer.state.restore_in_flight(in_flight)
        self.lookups_restored = bool(in_flight.get("lookups"))


@dataclass
class _Loop:
    """The bookkeeping of one `fit`: what it trained, when it last evaluated and checkpointed,
    the throughput window of the log lines, the progress bar and the profiled steps."""

    summary: TrainSummary
    record_steps: bool
    #: batches per epoch; None when `fit` trains a given batch iterator (no epochs)
    per_epoch: int | None
    #: whether this run evaluates (`trainer.eval_every` > 0 and held-out data)
    evaluating: bool
    bar: tqdm
    traced: StepWindow
    last: StepResult | None = None
    last_eval: int | None = None
    last_checkpoint: int | None = None
    window_start: float = field(default_factory=time.perf_counter)
    window_samples: int = 0
    #: torch.compile's counts at the last log step (`trainer.compile=true`): its seconds since
    #: then are left out of the window's samples/s
    compile_stats: CompileStats = field(default_factory=CompileStats)
    #: torch.compile's counts when this fit began
    initial_compile_stats: CompileStats = field(default_factory=CompileStats)
    #: every rank agreed to stop (SIGTERM); it does once the accumulation window is complete
    stopping: bool = False


class Trainer:
    """The training loop of a run, over its finished parts (`build_parts`: data, model,
    optimizer with its schedule, streams, the training pipeline, the evaluator, checkpointer and
    metrics writer), built once from a validated RunConfig and its compiled plan (after the
    process group exists) unless `parts` are given.

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
        parts: TrainParts | None = None,
    ):
        self.run, self.plan, self.info, self.run_dir = run, plan, info, run_dir
        self.parts = parts or build_parts(run, plan, info, run_dir, data)
        self.data, self.state, self.optimizer = self.parts.data, self.parts.state, self.parts.optimizer
        self.pipeline, self.evaluator = self.parts.pipeline, self.parts.evaluator
        #: this rank's random streams (dropout, evaluation, the global generators), checkpointed
        self.rng = self.parts.rng
        self.metrics, self.checkpointer = self.parts.metrics, self.parts.checkpointer
        if self.checkpointer is not None and info.is_main:
            self.checkpointer.on_published = lambda c: log.info("checkpoint step %d -> %s", c.step, c.path)
        #: training steps taken (over the whole run, across resumes): trained batches, so with
        #: gradient accumulation micro-steps (the optimizer steps every grad_accumulation.steps)
        self.step = 0
        #: the next training batch to train, counted across epochs
        self.position = 0
        #: SIGTERM handling (the CLI passes the one it installed for the whole process)
        self.stop = stop or StopRequest(info.control_group, run.trainer.preemption_check_s)
        #: heartbeats carry the step (set by the CLI for multi-rank runs)
        self.health = health

    @property
    def planned_steps(self) -> int:
        """Steps this configuration trains in all: `trainer.epochs` epochs, capped by `max_steps`."""
        return self.parts.planned_steps

    @property
    def eval_loader(self) -> Any:
        """The held-out loader of a ranking source (None for a retrieval source)."""
        return self.evaluator.loader

    @property
    def retrieval(self) -> RetrievalEvaluation | None:
        """A retrieval source's own validation/test evaluation (None for other sources)."""
        return self.evaluator.retrieval

    # -- checkpoints ----------------------------------------------------------------------------

    def checkpoint_state(self, eval_best: bool = True) -> dict[str, Any]:
        """What a checkpoint holds in DCP (`Stateful`s): model, optimizers, schedule, progress.
        Each rank's RNG states and what it has in flight (`_RankState`) are saved next to it."""
        return {"train": _TrainingState(self, eval_best)}

    def restore(self, path: str) -> None:
        """Continue from the checkpoint at `path`: weights, optimizer and schedule state, step,
        data position and (if the checkpoint has this rank's file) RNG states and what was in flight."""
        self.optimizer.prepare_load()
        try:
            # a checkpoint written before retrieval runs saved their best validation score has none
            state = self.checkpoint_state(eval_best=EVAL_BEST_KEY in read_metadata(Path(path)).state_dict_metadata)
            own = _RankState(self)
            with_rng = load_checkpoint(path, state, own, self.info.rank, self.info.checkpoint_group)
        except (RuntimeError, ValueError, KeyError) as exc:  # DCP's CheckpointException is a RuntimeError
            reason = str(exc).strip().splitlines()
            detail = next((line for line in reversed(reason) if "Error" in line), reason[0] if reason else "")
            raise ConfigError(
                ConfigProblem("trainer.resume_from", f"{path} does not fit this model and optimizer: {detail[:300]}")
            ) from exc
        if self.info.is_main:
            for line in self._resume_changes(path, own.lookups_restored):
                log.warning("resuming %s", line)
            log.info(
                "resumed from %s: step %d, epoch %d, batch %d of the epoch%s",
                path,
                self.step,
                self.position // self.data.batches_per_epoch + 1,
                self.position % self.data.batches_per_epoch,
                "" if with_rng else " (the checkpoint has no RNG state of this rank: fresh RNG)",
            )

    def _resume_changes(self, path: str, lookups_restored: bool) -> list[str]:
        """What this run changes about the checkpoint's run (its config.yaml), one line each:
        what is dropped or restarted. (A change that cannot load -- another model, an optimizer
        whose state the checkpoint lacks -- is refused by `restore` with exit 2.)"""
        lines = []
        if self.plan.config.torchrec_context == "semi_sync" and not lookups_restored and self.step < self.planned_steps:
            lines.append(
                f"a semi-synchronous plan ({self.run.pipeline.name}) from a checkpoint that holds no lookup in flight "
                "for this rank (written by another plan, or on another world size): the first batch is looked up "
                "from the checkpoint's tables, one update fresher than in the run that wrote it"
            )
        saved = saved_config(Path(path))
        if saved is None:
            return lines
        old_opt, new_opt = _key(saved, "optimizer.name"), self.run.optimizer.name
        if old_opt is not None and old_opt != new_opt:
            lines.append(
                f"with optimizer.name={new_opt}, the checkpoint's run used {old_opt}: its dense optimizer state "
                f"is dropped ({new_opt} starts from none)"
            )
        old_k = _key(saved, "trainer.grad_accumulation.steps") or 1
        new_k = self.run.trainer.grad_accumulation.steps
        if old_k != new_k:
            first = -(-self.step // new_k) * new_k
            lines.append(
                f"with trainer.grad_accumulation.steps={new_k}, the checkpoint's run used {old_k}: windows of {new_k} "
                f"micro-steps count from step 0, the first full one starts after step {first}"
            )
        old_plan, new_plan = _key(saved, "pipeline.name"), self.run.pipeline.name
        if old_plan is not None and old_plan != new_plan:
            lines.append(
                f"with pipeline={new_plan}, the checkpoint's run used {old_plan}: batches in flight are not part of a "
                "checkpoint, so the new plan refills its own"
            )
        return lines

    def save_checkpoint(self, blocking: bool = False) -> None:
        """Checkpoint the current step (every rank takes part); asynchronous as configured
        unless `blocking`. Needs a run directory."""
        assert self.checkpointer is not None
        self.checkpointer.save(self.step, self.checkpoint_state(), _RankState(self), blocking=blocking)

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
        (one pass, no epochs). Under `trainer.compile=true`, a torch.compile failure is a
        ConfigError naming the key (`compile_failures`).
        """
        with compile_failures(self.parts.compiled):
            return self._fit(batches, record_steps)

    def _fit(self, batches: Iterator | None, record_steps: bool) -> TrainSummary:
        summary = TrainSummary(start_step=self.step, stop_reason=self._nothing_to_train(batches is None))
        if summary.stop_reason:
            return summary
        self._warn_if_data_ends_first()
        results = self._start(batches)
        if results is None:
            summary.stop_reason = DATA_EXHAUSTED
            return summary
        loop = self._new_loop(summary, record_steps, None if batches is not None else self.data.batches_per_epoch)
        if loop.evaluating and self.step == 0:
            self._evaluate(loop)
        start = time.perf_counter()
        with self.stop, logging_redirect_tqdm():
            while not summary.stop_reason:
                result = self.train_step(results)
                if result is None:  # the data ended
                    summary.stop_reason = EPOCHS_DONE if loop.per_epoch else DATA_EXHAUSTED
                    break
                self._record(loop, result)
                self._log_progress(loop, result)
                if self._evaluation_due(loop):
                    self._evaluate(loop)
                summary.stop_reason = self._stop_reason(loop)
                self._checkpoint_if_due(loop, preempted=summary.stop_reason == PREEMPTED)
            self.stop.drain()
        self._flush_accumulation(summary)
        summary.seconds = time.perf_counter() - start
        if self.parts.compiled is not None:
            summary.compiled = self.parts.compiled.stats().since(loop.initial_compile_stats)
        self._finish(loop)
        return summary

    def train_step(self, results: Iterator[StepResult]) -> StepResult | None:
        """One training step: the pipeline trains the next batch (running this iteration's tasks,
        those of batches ahead included) and hands back its result; None once the data ended."""
        result = next(results, None)
        if result is not None:
            self.step += 1
            self.position += 1
            if self.health is not None:
                self.health.step = self.step
        return result

    def evaluate(self, record_batches: bool = False) -> dict[str, Any]:
        """The model's metrics on held-out data (`Evaluator.evaluate`), over all ranks.

        Evaluation draws from its own random stream (`RngState.evaluation`): training's draws,
        and so its losses, are the same whether and whenever it evaluates."""
        with self.rng.evaluation(self.step):
            return self.evaluator.evaluate(record_batches)

    def close(self) -> None:
        """Shut down the pipelines' worker threads, the state's resources and the metrics writer."""
        self.parts.close()

    # -- the loop's steps -------------------------------------------------------------------------

    def _nothing_to_train(self, epochs: bool) -> str:
        """The stop reason if the run is already done (e.g. resumed from the last checkpoint of a
        finished run), else ''."""
        cfg = self.run.trainer
        per_epoch = self.data.batches_per_epoch
        if cfg.max_steps is not None and self.step >= cfg.max_steps:
            reason, detail = MAX_STEPS, f"step {self.step} >= trainer.max_steps={cfg.max_steps}"
        elif epochs and self.position >= cfg.epochs * per_epoch:
            reason, detail = EPOCHS_DONE, f"batch {self.position} >= trainer.epochs={cfg.epochs} x {per_epoch} batches"
        else:
            return ""
        if self.info.is_main:
            log.warning("nothing to train: %s (raise it to train on)", detail)
        return reason

    def _start(self, batches: Iterator | None) -> Iterator[StepResult] | None:
        """Seed the training pipeline with the first batch (`TrainState.bootstrap`) and return its
        results; None if there is no batch to train."""
        it = iter(self.data.train_loader(self.run.trainer.epochs, self.position)) if batches is None else batches
        try:
            first = next(it)
        except StopIteration:
            log.warning("the training data yielded no batch")
            return None
        self.pipeline.seed_first_batch(it, self.state.bootstrap(first))
        self.state.start_step = self.step
        accumulation = self.state.grad_accumulation
        if accumulation is not None:  # micro-steps are counted over the run; the pipeline counts from 0
            accumulation.start(self.step, self.planned_steps - 1 if batches is None else None)
        return self.pipeline.iterate(it)

    def _new_loop(self, summary: TrainSummary, record_steps: bool, per_epoch: int | None) -> _Loop:
        cfg = self.run.trainer
        bar = tqdm(
            total=self.planned_steps,
            initial=self.step,
            desc="train",
            unit="step",
            # a log file gets the plain `step N | ...` lines only, not the bar's \r updates
            disable=not self.info.is_main or not cfg.progress_bar or not sys.stderr.isatty(),
            dynamic_ncols=True,
        )
        traced = StepWindow(cfg.torch_profiler.steps, self.run_dir or ".", self.info.rank, self.pipeline)
        traced.step(self.step)
        evaluating = self.evaluator.has_data and cfg.eval_every > 0
        loop = _Loop(summary, record_steps, per_epoch, evaluating, bar, traced)
        if self.parts.compiled is not None:  # counts of an earlier fit are not this one's
            loop.compile_stats = loop.initial_compile_stats = self.parts.compiled.stats()
        return loop

    def _record(self, loop: _Loop, result: StepResult) -> None:
        """Count the step's samples; keep its loss (and ids) where asked."""
        loop.traced.step(self.step)
        summary = loop.summary
        summary.steps += 1
        samples = result.num_samples * self.info.world_size // self.run.parallel.pp.size  # replicas
        summary.samples += samples
        loop.window_samples += samples
        if loop.record_steps:
            summary.losses.append(float(result.loss))
            summary.sample_ids.append(result.sample_ids.cpu())
        if summary.steps == 1:
            summary.first_loss = float(result.loss)
        loop.last = result
        loop.bar.update(1)

    def _log_progress(self, loop: _Loop, result: StepResult) -> None:
        """The log step's line and metrics record (every `trainer.log_every` steps), and the end
        of an epoch."""
        cfg = self.run.trainer
        if self.step % cfg.log_every == 0:
            now = time.perf_counter()
            compiled = self._compile_stats(loop)
            seconds = now - loop.window_start - (compiled.seconds - loop.compile_stats.seconds if compiled else 0.0)
            loss = self._log_step(result, loop.window_samples / max(seconds, 1e-9), compiled)
            loop.compile_stats = compiled or loop.compile_stats
            loop.bar.set_postfix(loss=f"{loss:.4f}")
            loop.window_start, loop.window_samples = now, 0
        if loop.per_epoch is not None and self.position % loop.per_epoch == 0 and self.info.is_main:
            log.info("epoch %d/%d done at step %d", self.position // loop.per_epoch, cfg.epochs, self.step)

    def _evaluation_due(self, loop: _Loop) -> bool:
        """Every `trainer.eval_every` steps and at the end of every `trainer.eval_epochs`-th epoch."""
        cfg = self.run.trainer
        if not loop.evaluating:
            return False
        epoch_end = loop.per_epoch is not None and self.position % loop.per_epoch == 0
        epoch_eval = epoch_end and cfg.eval_epochs > 0 and (self.position // loop.per_epoch) % cfg.eval_epochs == 0
        return epoch_eval or self.step % cfg.eval_every == 0

    def _evaluate(self, loop: _Loop) -> None:
        loop.summary.evals.append(self._log_eval(self.step, loop.record_steps))
        loop.last_eval = self.step

    def _stop_reason(self, loop: _Loop) -> str:
        """Why training stops after this step ('' to go on): a stop request (SIGTERM) that every
        rank agreed on after the same step, or `trainer.max_steps`. A stop inside a gradient
        accumulation window waits for the window's optimizer step: the checkpoint then loses
        no accumulated gradient (they are not part of it)."""
        if not loop.stopping and self.stop.should_stop():
            loop.stopping = True
            if self._inside_window() and self.info.is_main:
                window = self.state.grad_accumulation.steps  # type: ignore[union-attr]
                log.warning(
                    "%s received inside a gradient accumulation window: training on to step %d, the window's "
                    "optimizer step, before stopping",
                    self.stop.signal_name or "stop request",
                    -(-self.step // window) * window,
                )
        if loop.stopping and not self._inside_window():
            return PREEMPTED
        max_steps = self.run.trainer.max_steps
        return MAX_STEPS if max_steps is not None and self.step >= max_steps else ""

    def _inside_window(self) -> bool:
        """Whether gradients accumulated so far wait for an optimizer step."""
        accumulation = self.state.grad_accumulation
        return accumulation is not None and accumulation.pending(self.step)

    def _checkpoint_if_due(self, loop: _Loop, preempted: bool) -> None:
        """Every `trainer.checkpoint.interval` steps, and (blocking) when preempted."""
        if self.checkpointer is not None:
            self.checkpointer.poll()
            if preempted or self.checkpointer.due(self.step):
                self.save_checkpoint(blocking=preempted)
                loop.last_checkpoint = self.step
        if preempted:
            log.warning(
                "%s received: stopped after step %d on every rank%s",
                self.stop.signal_name or "stop request",
                self.step,
                f"; checkpoint {self.checkpointer.last.path}" if self.checkpointer else " (no run dir)",
            )

    def _flush_accumulation(self, summary: TrainSummary) -> None:
        """Training ended inside an accumulation window: step what was accumulated (torchrec's flush)."""
        if summary.stop_reason != PREEMPTED and self._inside_window():
            self.optimizer.step()
            self.optimizer.zero_grad()

    def _finish(self, loop: _Loop) -> None:
        """After the last step: close the trace and the bar; unless preempted, the last evaluation
        and checkpoint and the line saying why training stopped; wait for a pending save."""
        summary = loop.summary
        loop.traced.close()
        if loop.last is not None:
            summary.last_loss = float(loop.last.loss)
        loop.bar.close()
        if summary.stop_reason != PREEMPTED:
            if loop.evaluating and loop.last_eval != self.step:
                self._evaluate(loop)
            if self.checkpointer is not None and self.checkpointer.cfg.interval and loop.last_checkpoint != self.step:
                self.save_checkpoint()
            self._log_stop(summary)
        if self.checkpointer is not None:
            self.checkpointer.wait()
            summary.checkpoint = str(self.checkpointer.last.path) if self.checkpointer.last else None

    # -- helpers --------------------------------------------------------------------------------

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

    def _compile_stats(self, loop: _Loop) -> CompileStats | None:
        """torch.compile's counts now (None in eager mode); a line in the log when they changed
        since the last log step."""
        compiled = self.parts.compiled
        if compiled is None:
            return None
        stats = compiled.stats()
        if stats != loop.compile_stats and self.info.is_main:
            log.info("step %d | %s", self.step, stats.describe())
        return stats

    def _log_step(self, result: StepResult, samples_per_s: float, compiled: CompileStats | None = None) -> float:
        """Metrics record and console summary of a log step; returns the loss (mean over ranks).
        With `compiled`, the record carries torch.compile's counts (`CompileStats.record`)."""
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
        if compiled is not None:
            record.update(compiled.record())
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


def _key(config: dict[str, Any], path: str) -> Any:
    """The value at dotted `path` of a plain config mapping, None where it is missing."""
    node: Any = config
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _memory_gib(device: torch.device) -> float:
    """Peak memory of this rank: allocated device memory on CUDA, resident host memory else."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
