"""The training state the task functions share, and the bootstrap of the first batch.

Tasks are plain functions `fn(ctx)`; everything they need beyond their batch's slots (model,
optimizer, streams, torchrec's input distribution, the batch balancer, megatron-core's gradient
buffers) lives in one `TrainState`, passed to the engine as the plan runner's `state`. Evaluation reuses the same model
through `for_eval()`, a view whose tasks skip the optimizer work.

This module imports no torchrec: a model with plain torch tables trains without it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from recsys_pipe.engine import StreamPool
from recsys_pipe.train.slots import BATCH_CPU, BATCH_GPU, INPUT_DIST_SPLITS, TORCHREC_CTX

if TYPE_CHECKING:
    from recsys_pipe.train.grad_accumulation import GradAccumulation
    from recsys_pipe.train.shuffle import BatchBalancer
    from recsys_pipe.train.sparse_dist import TorchrecSparseDist

__all__ = ["GradBuffers", "TrainState"]


class GradBuffers(Protocol):
    """Gradients that backward leaves outside `param.grad` until the plan's `finalize_model_grads`
    task (megatron-core's DDP: `recsys_pipe.train.dense_ddp.MegatronGrads`)."""

    def reset(self) -> None:
        """The `zero_grad` task, after the optimizer's `zero_grad`: empty the buffers."""

    def finalize(self) -> None:
        """The `finalize_model_grads` task: reduce over the ranks and expose the result as each
        parameter's `.grad` for the optimizer step."""

    def close(self) -> None:
        """Training is over: release what the buffers hold on to."""


@dataclass
class TrainState:
    """What the tasks share. `training=False` makes forward run without grad and the
    zero_grad/backward/finalize/optimizer tasks do nothing (evaluation)."""

    model: nn.Module
    optimizer: Any
    device: torch.device
    streams: StreamPool
    #: torchrec's input distribution for models with sharded torchrec tables; None for plain
    #: torch tables (the input-dist tasks then have nothing to do).
    sparse_dist: TorchrecSparseDist | None = None
    #: the balanced batch shuffler of plans with start_shuffle / finish_shuffle tasks
    balancer: BatchBalancer | None = None
    training: bool = True
    #: megatron-core's gradient buffers (`trainer.dense_ddp=megatron`): reset by zero_grad,
    #: reduced by finalize_model_grads; None with torch DDP, which all-reduces the gradients into
    #: `.grad` during backward.
    grad_buffers: GradBuffers | None = None
    #: `trainer.precision=bf16`: the forward runs under autocast to this dtype
    autocast_dtype: torch.dtype | None = None
    #: `trainer.grad_accumulation.steps > 1`: which micro-steps clear, all-reduce and step
    grad_accumulation: GradAccumulation | None = None
    #: the previous batch's gradients, by parameter name (the stash_gradients task of semi_sync)
    grad_stash: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: the run's step of the plan runner's batch 0 (a resumed run's start step), so tasks can count
    #: steps over the run (`run_step`) rather than from this plan runner's start
    start_step: int = 0

    def run_step(self, batch_index: int) -> int:
        """The run's 0-based step of the plan runner's batch `batch_index`; evaluation batches count
        from 0 (evaluation trains no step)."""
        return batch_index + (self.start_step if self.training else 0)

    def in_flight(self) -> dict[str, Any]:
        """What the next steps depend on beyond the model and optimizer state, for a checkpoint
        of this rank (empty where nothing is in flight): the semi-synchronous plans' lookups
        already started for later steps (`lookups`, by the run's step: they read the tables
        before the last update) and the gradients a stash_gradients task keeps (`grad_stash`)."""
        state: dict[str, Any] = {}
        lookups = self.sparse_dist.lookups_in_flight() if self.sparse_dist is not None else {}
        if lookups:
            state["lookups"] = lookups
        if self.grad_stash:
            state["grad_stash"] = {name: grad.detach().clone() for name, grad in self.grad_stash.items()}
        return state

    def restore_in_flight(self, state: dict[str, Any]) -> None:
        """Take back what `in_flight` saved: the kept gradients at once, the lookups when their
        steps are looked up again."""
        self.grad_stash.clear()  # in place: views of the state share the dict
        self.grad_stash.update(state.get("grad_stash", {}))
        if self.sparse_dist is not None:
            self.sparse_dist.restore_lookups(state.get("lookups", {}))

    def autocast(self) -> torch.autocast:
        """The forward's autocast context (disabled without `autocast_dtype`). Autocast state is
        per thread, so the task running the forward enters it itself."""
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def for_eval(self) -> TrainState:
        """The same model, input distribution and streams, with the optimizer work switched off."""
        return dataclasses.replace(self, training=False)

    def bootstrap(self, cpu_batch: Any) -> dict[str, Any]:
        """The slots to seed the first batch with (`PlanRunner.seed_first_batch`).

        With torchrec tables, the model is rewritten for pipelining on this batch: it is moved,
        traced and its input dist started, and those slots are returned so it is trained like
        any other batch (not thrown away); the tasks see them and skip the work already done.
        In plans that balance batches this first batch is trained as loaded, on every rank.
        Without torchrec tables there is nothing to prepare.
        """
        if self.sparse_dist is None:
            return {BATCH_CPU: cpu_batch}
        batch = cpu_batch.to(self.device, non_blocking=True)
        context = self.sparse_dist.new_context(0)
        splits = self.sparse_dist.rewrite(batch, context)
        return {BATCH_CPU: cpu_batch, BATCH_GPU: batch, TORCHREC_CTX: context, INPUT_DIST_SPLITS: splits}

    def close(self) -> None:
        """Stop background work (the balancer's solver thread), release the gradient buffers'
        state (megatron-core's model-parallel groups)."""
        if self.balancer is not None:
            self.balancer.close()
        if self.grad_buffers is not None:
            self.grad_buffers.close()
