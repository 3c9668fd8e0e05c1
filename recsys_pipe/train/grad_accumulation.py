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
  cleared (torchrec's flush), by `Trainer.fit`; a SIGTERM inside a window lets the window
  finish (its optimizer step) before the checkpoint, so no accumulated gradient is lost;
- the loss is not scaled (torchrec sums the k gradients); `scale_loss: true` multiplies it by
  1/k in backward, so the step sees the mean over the window instead.

Embedding tables whose optimizer is fused into backward (torchrec's sharded tables) are updated
by every micro-step's backward, as under torchrec's wrapper: accumulation applies to the dense
parameters.

A resumed run starts at a window boundary (checkpoints are taken there), on a micro-step that
runs under `no_sync` in the uninterrupted run. torch DDP with `static_graph=True` (torchrec's
DMP wraps the dense part so) cannot take its first backward under `no_sync` (its delayed
first-iteration all-reduce asserts, reducer.cpp `expect_autograd_hooks_`), and syncing there
would average one micro-step's gradients early: the same mean, other rounding. So the first
micro-step of a `fit` that would not sync runs *synced* on such modules, through a DDP
communication hook (`_LocalFirstBackward`) that leaves that one backward's gradients local
(no all-reduce, no division): bitwise what `no_sync` gives. Every later all-reduce goes through
the hook as DDP's built-in one does it (scale by 1/world size, then sum).

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

import torch
import torch.distributed as dist
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

    `start_step` is the micro-step of the plan runner's batch 0 (the trainer's step when `fit`
    starts); `last_step`, when the run's length is known, the last micro-step it trains.
    """

    def __init__(self, cfg: GradAccumulationConfig, model: nn.Module):
        self.steps, self.warmup_steps = cfg.steps, cfg.warmup_steps
        self.loss_scale = 1.0 / cfg.steps if cfg.scale_loss else 1.0
        self.start_step = 0
        self.last_step: int | None = None
        self.ddp_modules = _no_sync_modules(model)
        #: the hooks of static-graph DDP modules whose first backward is still to come (see the
        #: module docstring), by module id; installed by `start` when that backward would not sync
        self._first_backward: dict[int, _LocalFirstBackward] = {}
        self._backward_done = False
        #: the micro-step whose backward is the model's first, when it must stay local
        self._local_step: int | None = None

    def start(self, start_step: int, last_step: int | None) -> None:
        """A `fit` begins: its first batch is micro-step `start_step`; `last_step` is the run's
        last planned micro-step (None: unknown)."""
        self.start_step, self.last_step = start_step, last_step
        self._local_step = None
        if self._backward_done or self.syncs(start_step):
            return
        for module in self.ddp_modules:
            if getattr(module, "static_graph", False) and id(module) not in self._first_backward:
                hook = _LocalFirstBackward(module.process_group)
                module.register_comm_hook(None, hook.reduce)
                self._first_backward[id(module)] = hook
        if self._first_backward:
            self._local_step = start_step

    def micro_step(self, batch_index: int) -> int:
        """The run's micro-step of the plan runner's batch `batch_index`."""
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
        self._backward_done = True
        if self.syncs(step):
            yield
            return
        local = step == self._local_step
        with contextlib.ExitStack() as stack:
            for module in self.ddp_modules:
                hook = self._first_backward.get(id(module)) if local else None
                if hook is None:
                    stack.enter_context(module.no_sync())
                else:  # synced for DDP, local in effect (see the module docstring)
                    stack.enter_context(hook.local())
            yield


class _LocalFirstBackward:
    """DDP communication hook (`register_comm_hook`) of a static-graph DDP module whose first
    backward must not sync: inside `local()` a bucket is handed back as it is (the gradients
    stay this rank's, as under `no_sync`); otherwise it is reduced as DDP's built-in all-reduce
    does (multiplied by 1/world size while copied into the bucket, then summed over the ranks),
    so later steps are bitwise those of a module without the hook. Hand-written: torch offers no
    hook that skips one backward's communication, and DDP takes one hook for its lifetime."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._local = False

    @contextlib.contextmanager
    def local(self) -> Iterator[None]:
        self._local = True
        try:
            yield
        finally:
            self._local = False

    # not annotated: DDP checks a hook's annotations against the classes themselves, and
    # `from __future__ import annotations` makes them strings
    def reduce(self, state, bucket):  # type: ignore[no-untyped-def]
        """A bucket of `dist.GradBucket` -> the future of its reduced buffer."""
        buffer = bucket.buffer()
        if self._local:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(buffer)
            return done
        buffer.mul_(1.0 / dist.get_world_size(self.group))
        reduced = dist.all_reduce(buffer, group=self.group, async_op=True)
        assert reduced is not None
        return reduced.get_future().then(lambda fut: fut.value()[0])


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
