"""Gradient accumulation as config (`trainer.grad_accumulation.*`), for every plan.

torchrec's semantics (`torchrec.distributed.train_pipeline.GradientAccumulationWrapper`), per
training micro-step c (one trained batch, counted over the run from 0), with k = `steps`:

- the optimizer steps after micro-steps c with (c + 1) % k == 0, and gradients are cleared
  before micro-steps with c % k == 0: one optimizer step and one zero_grad per window of k;
- the dense gradients are all-reduced (DDP) on micro-step 0, on every micro-step before
  `warmup_steps`, on the last micro-step of each window, and on the run's last planned step
  (torchrec's `is_last_batch`); on the others the forward and backward run under DDP's
  `no_sync` on every DDP module of the model (the root wrapper and any inner DDP);
- if training stops inside a window, the accumulated gradients are stepped once more and
  cleared (torchrec's flush), by `Trainer.fit`;
- the loss is not scaled (torchrec sums the k gradients); `scale_loss: true` multiplies it by
  1/k in backward, so the step sees the mean over the window instead.

Embedding tables whose optimizer is fused into backward (torchrec's sharded tables) are updated
by every micro-step's backward, as under torchrec's wrapper: accumulation applies to the dense
parameters.

Why not torchrec's wrapper itself: it wraps one pipeline object's whole `progress()` call and
intercepts that pipeline's optimizer. Here each decision is taken by the task of a given batch
(zero_grad, forward, backward, optimizer_step), whatever plan, executor thread or lookahead
runs it, so the per-step rules above are stated as functions of the micro-step; the parity test
checks them bitwise against torchrec's wrapper around `TrainPipelineSparseDist`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pydantic import Field, StrictBool, StrictInt
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recsys_pipe.config import Section

__all__ = ["GradAccumulation", "GradAccumulationConfig", "check_grad_accumulation"]


class GradAccumulationConfig(Section):
    """Gradient accumulation (`trainer.grad_accumulation.*`), torchrec's semantics."""

    steps: StrictInt = Field(1, ge=1, description="micro-batches per optimizer step (1: no accumulation)")
    warmup_steps: StrictInt = Field(
        1, ge=1, description="the first N micro-steps all-reduce their gradients (at least the first, for DDP)"
    )
    scale_loss: StrictBool = Field(
        False, description="multiply the loss by 1/steps in backward (torchrec: false, the gradients are summed)"
    )

    @property
    def enabled(self) -> bool:
        return self.steps > 1


class GradAccumulation:
    """The per-micro-step decisions of gradient accumulation for one model.

    `start_step` is the micro-step of the pipeline's batch 0 (the trainer's step when `fit`
    starts); `last_step`, when the run's length is known, the last micro-step it trains.
    """

    def __init__(self, cfg: GradAccumulationConfig, model: nn.Module):
        self.steps, self.warmup_steps = cfg.steps, cfg.warmup_steps
        self.loss_scale = 1.0 / cfg.steps if cfg.scale_loss else 1.0
        self.start_step = 0
        self.last_step: int | None = None
        self.ddp_modules = _no_sync_modules(model)

    def micro_step(self, batch_index: int) -> int:
        """The run's micro-step of the pipeline's batch `batch_index`."""
        return self.start_step + batch_index

    def clears_grad(self, step: int) -> bool:
        """zero_grad runs before the first micro-step of each window."""
        return step % self.steps == 0

    def steps_optimizer(self, step: int) -> bool:
        """The optimizer steps after the last micro-step of each window."""
        return (step + 1) % self.steps == 0

    def syncs(self, step: int) -> bool:
        """Whether this micro-step all-reduces the dense gradients (torchrec's `_should_sync_grad`)."""
        return step == 0 or step < self.warmup_steps or self.steps_optimizer(step) or step == self.last_step

    def pending(self, steps_done: int) -> bool:
        """After `steps_done` micro-steps, whether a window is open (gradients not stepped yet)."""
        return steps_done % self.steps != 0

    @contextlib.contextmanager
    def grad_sync(self, step: int) -> Iterator[None]:
        """The context of micro-step `step`'s forward and backward: `no_sync` on every DDP
        module unless the step all-reduces."""
        if self.syncs(step):
            yield
            return
        with contextlib.ExitStack() as stack:
            for module in self.ddp_modules:
                stack.enter_context(module.no_sync())
            yield


def _no_sync_modules(model: nn.Module) -> list[Any]:
    """The modules whose `no_sync` must be entered, found as torchrec's wrapper finds them: the
    root (unwrapping torchrec's DistributedModelParallel) if it has `no_sync` (DDP or another
    data-parallel wrapper), and every DistributedDataParallel below it."""
    root = getattr(model, "_dmp_wrapped_module", model)
    modules = [root] if hasattr(root, "no_sync") else []
    modules += [m for m in root.modules() if m is not root and isinstance(m, DistributedDataParallel)]
    return modules


def check_grad_accumulation(cfg: GradAccumulationConfig, checkpoint_interval: int, dense_ddp: str) -> None:
    """ValueError for settings gradient accumulation cannot honour (checked by `TrainerConfig`,
    so the run is refused before anything starts): a checkpoint inside a window would lose the
    gradients accumulated so far (they are not part of the checkpoint), and megatron-core's DDP
    reduces its gradient buffers in `finalize_model_grads`, which these rules do not gate.

    Args:
        cfg: `trainer.grad_accumulation`.
        checkpoint_interval: `trainer.checkpoint.interval`.
        dense_ddp: `trainer.dense_ddp`.
    """
    steps = cfg.steps
    if steps == 1:
        return
    if checkpoint_interval % steps:
        raise ValueError(
            f"trainer.checkpoint.interval={checkpoint_interval} is not a multiple of "
            f"trainer.grad_accumulation.steps={steps}: a checkpoint inside an accumulation window would drop its "
            "gradients"
        )
    if dense_ddp == "megatron":
        raise ValueError(
            "trainer.grad_accumulation.steps > 1 needs trainer.dense_ddp=torch (megatron-core's DDP reduces in "
            "finalize_model_grads, which accumulation does not gate)"
        )
