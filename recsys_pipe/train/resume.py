"""Checkpoint and resume of a training run: what a checkpoint holds of the run (model,
optimizers, learning-rate schedule, the loop's position, a retrieval run's best validation score; each rank's
RNG states and what it has in flight), when one is due, and how a run continues from one.

`RunCheckpointer` is a finished part of a run (`recsys_pipe.train.build.build_parts`): the loop
only calls `save_if_due(step)` after each step and `finish(step)` at the end; a command that
only evaluates a checkpoint needs nothing but `restore(path)`. Writing the DCP directories
(atomic publication, pruning, asynchronous saves) is `recsys_pipe.train.checkpoint.Checkpointer`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem
from recsys_pipe.data import RankData
from recsys_pipe.runtime.distributed import DistInfo
from recsys_pipe.train.checkpoint import Checkpointer, load_checkpoint, read_metadata, saved_config
from recsys_pipe.train.config import RunConfig
from recsys_pipe.train.fingerprint import FINGERPRINT_FILE, fingerprint
from recsys_pipe.train.managed import MANAGED_STATE_KEY, history_state, load_history_state
from recsys_pipe.train.optim import TrainOptimizer
from recsys_pipe.train.progress import RunPosition
from recsys_pipe.train.retrieval_eval import RetrievalEvaluation
from recsys_pipe.train.rng import RngState
from recsys_pipe.train.state import TrainState

__all__ = ["EVAL_BEST_KEY", "IN_FLIGHT_KEY", "RunCheckpointer"]

log = logging.getLogger(__name__)

#: DCP key of a retrieval run's best validation score so far (`_ProgressState`)
EVAL_BEST_KEY = "train.progress.eval_best"
#: DCP key of the layouts the current epoch was trained under (`RankData.layout_state`)
DATA_LAYOUT_KEY = "train.progress.data_layout"
#: the key of `TrainState.in_flight` in a rank's own checkpoint file, next to its RNG states
IN_FLIGHT_KEY = "in_flight"


class RunCheckpointer:
    """Saves a run's checkpoints when due and restores a run from one.

    Args:
        run, plan, info: the run's config, its compiled plan, this rank's process groups.
        data: this rank's data (its layout is checkpointed, to resume on another world size).
        state, optimizer, rng: what is saved besides the position.
        retrieval: a retrieval source's evaluation (its best score so far is saved), or None.
        position: the loop's position, saved and restored in place.
        planned_steps: steps the run trains in all (a finished run warns nothing on resume).
        writer: writes the checkpoint directories; None without a run directory (restore only).
    """

    def __init__(
        self,
        run: RunConfig,
        plan: CompiledPlan,
        info: DistInfo,
        data: RankData,
        state: TrainState,
        optimizer: TrainOptimizer,
        rng: RngState,
        retrieval: RetrievalEvaluation | None,
        position: RunPosition,
        planned_steps: int,
        writer: Checkpointer | None,
    ):
        self.run, self.plan, self.info, self.data = run, plan, info, data
        self.state, self.optimizer, self.rng, self.retrieval = state, optimizer, rng, retrieval
        self.position, self.planned_steps, self.writer = position, planned_steps, writer
        if writer is not None and info.is_main:
            writer.on_published = lambda c: log.info("checkpoint step %d -> %s", c.step, c.path)
            # which experiment each checkpoint is of (`trainer.resume_from=latest` takes only its own)
            writer.files[FINGERPRINT_FILE] = fingerprint(run, info.world_size).to_json()
        #: the step of the last checkpoint this run saved
        self.last_saved: int | None = None

    @property
    def last_path(self) -> str | None:
        """The last checkpoint written and published (a directory), if any."""
        if self.writer is None or self.writer.last is None:
            return None
        return str(self.writer.last.path)

    # -- saving ---------------------------------------------------------------------------------

    def state_dict_items(self, eval_best: bool = True, data_layout: bool = True) -> dict[str, Any]:
        """What a checkpoint holds in DCP (`Stateful`s): model, optimizers, LR schedule, progress.
        Each rank's RNG states and what it has in flight (`_RankState`) are saved next to it."""
        return {"train": _TrainingState(self, eval_best, data_layout)}

    def save(self, step: int, blocking: bool = False) -> None:
        """Checkpoint `step` (every rank takes part); asynchronous as configured unless
        `blocking`. Needs a run directory."""
        assert self.writer is not None
        self.writer.save(step, self.state_dict_items(), _RankState(self), blocking=blocking)
        self.last_saved = step

    def save_if_due(self, step: int, preempted: bool = False) -> bool:
        """Save after `step` every `trainer.checkpoint.interval` steps, and (blocking) when
        preempted; publishes a finished asynchronous save first. Returns whether it saved."""
        if self.writer is None:
            return False
        self.writer.poll()
        if preempted or self.writer.due(step):
            self.save(step, blocking=preempted)
            return True
        return False

    def finish(self, step: int) -> None:
        """The end of training: a last checkpoint (with checkpoints configured) unless `step` has one."""
        if self.writer is not None and self.writer.cfg.interval and self.last_saved != step:
            self.save(step)

    def wait(self) -> None:
        """Block until a pending asynchronous save is written and published."""
        if self.writer is not None:
            self.writer.wait()

    # -- resuming -------------------------------------------------------------------------------

    def restore(self, path: str) -> None:
        """Continue from the checkpoint at `path`: weights, optimizer and LR schedule state, step,
        data position and (if the checkpoint has this rank's file) RNG states and what was in flight."""
        self.optimizer.prepare_load()
        try:
            # a checkpoint written before retrieval runs saved their best validation score has none,
            # one written before the data layout was saved has none of that
            saved = read_metadata(Path(path)).state_dict_metadata
            state = self.state_dict_items(eval_best=EVAL_BEST_KEY in saved, data_layout=DATA_LAYOUT_KEY in saved)
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
                self.position.step,
                self.position.batch // self.data.batches_per_epoch + 1,
                self.position.batch % self.data.batches_per_epoch,
                "" if with_rng else " (the checkpoint has no RNG state of this rank: fresh RNG)",
            )

    def _resume_changes(self, path: str, lookups_restored: bool) -> list[str]:
        """What this run changes about the checkpoint's run (its config.yaml), one line each:
        what is dropped or restarted. (A change that cannot load -- another model, an optimizer
        whose state the checkpoint lacks -- is refused by `restore` with exit 2.)"""
        lines = []
        step = self.position.step
        if self.plan.config.torchrec_context == "semi_sync" and not lookups_restored and step < self.planned_steps:
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
            first = -(-step // new_k) * new_k
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


class _ProgressState:
    """The checkpointed part of the loop itself: step, data position and the run's data layout
    (so a resume on another world size can map the position onto its own batches), and for a
    retrieval run the best validation score so far, so that a resumed run's `eval_dump` still
    holds the evaluation validation picks over the whole run. `eval_best=False` leaves that out
    (loading a checkpoint written before it was saved)."""

    def __init__(self, owner: RunCheckpointer, eval_best: bool = True, data_layout: bool = True):
        self.owner = owner
        self.eval_best = eval_best and owner.retrieval is not None
        #: whether the data layouts of the current epoch are saved (`RankData.layout_state`)
        self.data_layout = data_layout

    def state_dict(self) -> dict[str, Any]:
        c = self.owner
        state = {
            "step": c.position.step,
            "position": c.position.batch,
            "batches_per_epoch": c.data.batches_per_epoch,
            "batch_size": c.run.data.batch_size,
            "world_size": c.info.world_size,
        }
        if self.data_layout:
            state["data_layout"] = c.data.layout_state(c.position.batch)
        if self.eval_best:
            assert c.retrieval is not None
            state["eval_best"] = float("-inf") if c.retrieval.best is None else c.retrieval.best
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        c = self.owner
        c.position.step = int(state["step"])
        c.position.batch = int(state["position"])
        if self.eval_best and c.retrieval is not None:
            best = float(state["eval_best"])
            c.retrieval.best = None if best == float("-inf") else best
        # another world size or batch size: the data module maps the position onto this run's batches
        c.position.batch = c.data.resume_position(
            c.position.batch,
            int(state["world_size"]),
            int(state["batch_size"]),
            int(state["batches_per_epoch"]),
            state.get("data_layout") if self.data_layout else None,
        )


class _TrainingState:
    """`Stateful` view of everything the ranks share in a checkpoint: model (sharded tables and
    dense weights), both optimizers, LR scheduler and the loop's progress."""

    def __init__(self, owner: RunCheckpointer, eval_best: bool = True, data_layout: bool = True):
        self.owner = owner
        self.progress = _ProgressState(owner, eval_best, data_layout)

    def state_dict(self) -> dict[str, Any]:
        c = self.owner
        return {
            "model": c.state.model.state_dict(),
            "optim": c.optimizer.state_dict(),
            "progress": self.progress.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        c = self.owner
        c.state.model.load_state_dict(state["model"])
        c.optimizer.load_state_dict(state["optim"])
        self.progress.load_state_dict(state["progress"])


class _RankState:
    """`Stateful` of what a checkpoint holds for one rank only: its RNG states (`RngState`),
    what is in flight (`TrainState.in_flight`: a semi-synchronous plan's started lookups and
    kept gradients, absent otherwise) and its managed tables' ids counted since their last
    eviction (`recsys_pipe.train.managed.history_state`, absent without managed tables).
    `lookups_restored` says whether the loaded file had lookups in flight."""

    def __init__(self, owner: RunCheckpointer):
        self.owner = owner
        self.lookups_restored = False

    def state_dict(self) -> dict[str, Any]:
        state = self.owner.rng.state_dict()
        in_flight = self.owner.state.in_flight()
        if in_flight:
            state[IN_FLIGHT_KEY] = in_flight
        managed = history_state(self.owner.state.model)
        if managed:
            state[MANAGED_STATE_KEY] = managed
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.owner.rng.load_state_dict(state)
        load_history_state(self.owner.state.model, state.get(MANAGED_STATE_KEY, {}))
        in_flight = state.get(IN_FLIGHT_KEY, {})
        self.owner.state.restore_in_flight(in_flight)
        self.lookups_restored = bool(in_flight.get("lookups"))


def _key(config: dict[str, Any], path: str) -> Any:
    """The value at dotted `path` of a plain config mapping, None where it is missing."""
    node: Any = config
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node
