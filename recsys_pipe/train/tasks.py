"""The recommendation-training task functions, one per part of a training step.

Each is `fn(ctx)` over its batch's slots (`ctx.slots`, named in `recsys_pipe.train.slots`) and
the shared `TrainState` (`ctx.state`), registered by name with `@task` (`recsys_pipe.config.
task_registry`) together with what it needs from the run: plans in conf/pipeline/ write
`fn: h2d`, and the plan builder asks the tasks what to build. The same functions serve
the serial plan and the plans with lookaheads, and every model: they use only the batch and model protocols
(`recsys_pipe.data.batch`, `recsys_pipe.models.base`). A model with torchrec tables has
`state.sparse_dist` (torchrec's input distribution, `recsys_pipe.train.sparse_dist`); for plain
torch tables it is None and the input-dist tasks have nothing to do.

This module imports no torchrec and no megatron-core (their objects come through the state).

Effects outside the slots are declared (`declare_effects`) so that shortcut replay (exposed-time
profiling) skips only what it can replay: `h2d` (its replay hands out a fresh torchrec context),
the shuffle tasks and `global_tokens_allreduce` (slots only). The others change torchrec's
per-batch context in place (one-shot awaitables of collectives in flight), module state, the
embedding cache, gradients or parameters, which no capture/restore can replay without doing the
work itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from pydantic import Field, StrictBool

from recsys_pipe.config.schema import Section
from recsys_pipe.config.task_registry import Need, task, task_options
from recsys_pipe.engine import DeclaredIO, TaskContext, declare_effects
from recsys_pipe.engine.streams import DEFAULT_STREAM
from recsys_pipe.train.slots import (
    BATCH_CPU,
    BATCH_GPU,
    GLOBAL_TOKENS,
    INPUT_DIST_SPLITS,
    INPUT_DIST_TENSORS,
    LOSS,
    MODEL_OUT,
    PREFETCHED_INPUT,
    SHUFFLE_PLAN,
    STEP_RESULT,
    TORCHREC_CTX,
    UNBALANCED_BATCH,
)
from recsys_pipe.train.state import TrainState

__all__ = [
    "H2DOptions",
    "StepResult",
    "backward",
    "finalize_model_grads",
    "finish_shuffle",
    "forward",
    "global_tokens_allreduce",
    "h2d",
    "optimizer_step",
    "prefetch_embeddings",
    "start_input_dist",
    "start_shuffle",
    "wait_input_dist",
    "zero_grad",
]


@dataclass(frozen=True)
class StepResult:
    """What `progress()` returns for one batch (the `step_result` slot)."""

    loss: torch.Tensor
    logits: torch.Tensor
    labels: torch.Tensor
    sample_ids: torch.Tensor
    global_tokens: torch.Tensor | None
    #: every output of the model (detached), e.g. the retrieval models' evaluation ranks
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        """The number of samples the step trained (`sample_ids`' length)."""
        return int(self.sample_ids.numel())


def _keep_alive(batch: Any, ctx: TaskContext[TrainState]) -> None:
    """On CUDA, keep the caching allocator from recycling a batch made on this task's stream
    while tasks on the other streams read it."""
    streams = ctx.state.streams
    if streams.is_cuda:
        for name in streams.names:
            if name != ctx.task.stream:
                batch.record_stream(streams.get(name))


def _grad_sync(ctx: TaskContext[TrainState]) -> Any:
    """The trained batch's gradient all-reduce context (`no_sync` on a non-final micro-step of
    gradient accumulation, else nothing)."""
    accumulation = ctx.state.grad_accumulation
    if accumulation is None or not ctx.state.training:
        return contextlib.nullcontext()
    return accumulation.grad_sync(accumulation.micro_step(ctx.batch_index))


def _fresh_context(ctx: TaskContext[TrainState], _: None) -> None:
    """Replay of h2d: the recorded device batch (later tasks only read it) and a new context."""
    sparse = ctx.state.sparse_dist
    ctx.slots.set(TORCHREC_CTX, sparse.new_context(ctx.batch_index) if sparse is not None else None)


class H2DOptions(Section):
    """`pipeline.tasks.<h2d task>.options`."""

    inplace_copy: StrictBool = Field(
        False,
        description="allocate the device batch on the default stream and copy into it on the task's stream "
        "(torchrec's enable_inplace_copy_batch): no record_stream, so the allocator does not keep side-stream "
        "copies alive; false: copy with .to() on the task's stream and record the batch on the other streams",
    )


@declare_effects(
    "creates the batch's torchrec context, which the input-dist, prefetch and forward tasks fill and empty in place",
    DeclaredIO(capture=lambda ctx: None, restore=_fresh_context),
)
@task("h2d", options=H2DOptions)
def h2d(ctx: TaskContext[TrainState]) -> None:
    """batch_cpu -> device on the task's (memcpy) stream, plus the batch's torchrec context. The
    device batch goes to `batch_gpu`, or to `unbalanced_batch` in plans that balance batches (then
    finish_shuffle writes `batch_gpu`).

    Two ways to copy (`options.inplace_copy`), as torchrec's pipelines:

    * `.to(device)` on the task's stream: the memory belongs to that stream, so every other
      stream that reads the batch is recorded on it (`record_stream`), and the caching allocator
      keeps the block until those streams are done -- memory held beyond the batch's life;
    * in place: the device batch is allocated on the default stream (which trains it and frees
      it), the task's stream waits for that allocation, and the copy fills it. No
      `record_stream`: the default stream's order keeps the block alive while the batch is read.
    """
    slots, state = ctx.slots, ctx.state
    if BATCH_GPU in slots:  # the bootstrap batch: moved already
        return
    host = slots[BATCH_CPU]
    streams = state.streams
    if task_options(ctx, H2DOptions).inplace_copy:
        with streams.use(DEFAULT_STREAM):
            batch = host.empty_like(state.device)
        ctx.stream.wait_stream(streams.get(DEFAULT_STREAM))  # the allocation happens-before the copy
        batch.copy_(host, non_blocking=True)
    else:
        batch = host.to(state.device, non_blocking=True)
        _keep_alive(batch, ctx)
    balancing = any(slot.name == UNBALANCED_BATCH for slot in ctx.task.writes)
    slots.set(UNBALANCED_BATCH if balancing else BATCH_GPU, batch)
    sparse = state.sparse_dist
    slots.set(TORCHREC_CTX, sparse.new_context(ctx.batch_index) if sparse is not None else None)


@task("start_shuffle", needs={Need.BALANCER})
def start_shuffle(ctx: TaskContext[TrainState]) -> None:
    """Balanced shuffler, first half: all-gather the batch's per-sample costs and start solving
    the partition on the balancer's background thread (the future goes to `shuffle_plan`)."""
    slots = ctx.slots
    if BATCH_GPU in slots:  # the bootstrap batch: prepared already, trained as loaded
        return
    slots.set(SHUFFLE_PLAN, ctx.state.balancer.start(slots[UNBALANCED_BATCH]))


@task("finish_shuffle", needs={Need.BALANCER})
def finish_shuffle(ctx: TaskContext[TrainState]) -> None:
    """Balanced shuffler, second half: wait for this batch's partition and exchange samples, so
    `batch_gpu` holds this rank's balanced share. (It also counts the balance statistics, which
    only the end-of-run report reads: no effect a later task depends on.)"""
    slots = ctx.slots
    if BATCH_GPU in slots:  # the bootstrap batch
        return
    batch = ctx.state.balancer.finish(slots[UNBALANCED_BATCH], slots[SHUFFLE_PLAN])
    _keep_alive(batch, ctx)
    slots.set(BATCH_GPU, batch)


@declare_effects(
    "starts the input all-to-alls and keeps their one-shot awaitables in the batch's torchrec context "
    "(changed in place)"
)
@task("start_input_dist", needs={Need.SPARSE_DIST})
def start_input_dist(ctx: TaskContext[TrainState]) -> None:
    """torchrec `_start_data_dist`: per-module input dists and the fused splits all-to-all."""
    slots, sparse = ctx.slots, ctx.state.sparse_dist
    if INPUT_DIST_SPLITS in slots:  # the bootstrap batch: started by the model rewrite
        return
    slots.set(INPUT_DIST_SPLITS, sparse.start(slots[BATCH_GPU], slots[TORCHREC_CTX]) if sparse is not None else None)


@declare_effects(
    "waits for the input splits and starts the tensors all-to-all, moving one-shot awaitables within "
    "the batch's torchrec context (changed in place)"
)
@task("wait_input_dist", needs={Need.SPARSE_DIST})
def wait_input_dist(ctx: TaskContext[TrainState]) -> None:
    """Wait for the splits; this issues the tensors all-to-all (torchrec's wait_sparse_data_dist)."""
    sparse = ctx.state.sparse_dist
    ctx.slots.set(INPUT_DIST_TENSORS, sparse.wait(ctx.slots[TORCHREC_CTX]) if sparse is not None else None)


@declare_effects(
    "moves the batch's input-dist results within its torchrec context (changed in place) and warms "
    "the embedding cache that forward reads"
)
@task("prefetch_embeddings", needs={Need.SPARSE_DIST, Need.PREFETCH_CONTEXT})
def prefetch_embeddings(ctx: TaskContext[TrainState]) -> None:
    """Wait for the input tensors and warm the embedding cache (`module.prefetch`) for the
    batch the next forward will train. CPU kernels have no cache: the wait is the real work."""
    sparse = ctx.state.sparse_dist
    ctx.slots.set(PREFETCHED_INPUT, sparse.prefetch(ctx.slots[TORCHREC_CTX]) if sparse is not None else None)


@declare_effects("clears every parameter's gradient (.grad), which backward accumulates into")
@task("zero_grad")
def zero_grad(ctx: TaskContext[TrainState]) -> None:
    """The optimizer's zero_grad, and with megatron-core's DDP its gradient buffers' reset."""
    state = ctx.state
    accumulation = state.grad_accumulation
    if state.training and (accumulation is None or accumulation.clears_grad(accumulation.micro_step(ctx.batch_index))):
        state.optimizer.zero_grad()
        if state.grad_buffers is not None:
            state.grad_buffers.reset()


@task("global_tokens_allreduce")
def global_tokens_allreduce(ctx: TaskContext[TrainState]) -> None:
    """The loss tokens of this step summed over all ranks (`model.loss_normalization=global_tokens`
    adds this task to the plan; `forward` divides by it)."""
    tokens = ctx.slots[BATCH_GPU].num_loss_tokens()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tokens)
    ctx.slots.set(GLOBAL_TOKENS, tokens)


@declare_effects(
    "points the pipelined forwards at the batch's torchrec context, consumes its input-dist results "
    "(and prefetched embedding cache rows) and starts the embedding output all-to-all"
)
@task("forward")
def forward(ctx: TaskContext[TrainState]) -> None:
    """model(batch); with torchrec tables through the rewritten forward, whose embedding lookup
    uses this batch's already distributed input (`bind` ties the shared pipelined forwards to
    it). With a `global_tokens` slot (global-token normalisation) the loss is the model's
    `loss_sum` times the world size over all ranks' tokens, so DDP's average over ranks gives the
    global mean."""
    slots, state = ctx.slots, ctx.state
    if state.sparse_dist is not None:
        state.sparse_dist.bind(slots[TORCHREC_CTX])
    # grad mode and autocast are per thread: set them explicitly
    with torch.set_grad_enabled(state.training), state.autocast(), _grad_sync(ctx):
        loss, outputs = state.model(slots[BATCH_GPU])
        tokens = slots.get(GLOBAL_TOKENS)
        if tokens is not None:  # normalise by all ranks' tokens; DDP then averages over ranks
            world = dist.get_world_size() if dist.is_initialized() else 1
            loss = outputs["loss_sum"] * world / tokens.squeeze(0)
    slots.set(LOSS, loss)
    slots.set(MODEL_OUT, outputs)


@declare_effects(
    "accumulates parameter gradients, updates the fused embedding tables and their optimizer state, "
    "all-reduces dense gradients (DDP)"
)
@task("backward")
def backward(ctx: TaskContext[TrainState]) -> None:
    """loss.backward(): output-dist backward, fused embedding update, DDP all-reduce."""
    accumulation = ctx.state.grad_accumulation
    if not ctx.state.training:
        return
    loss = ctx.slots[LOSS]
    with _grad_sync(ctx):
        (loss if accumulation is None or accumulation.loss_scale == 1.0 else loss * accumulation.loss_scale).backward()


@declare_effects("finalizes the dense gradients in place (megatron-core DDP)")
@task("finalize_model_grads", needs={Need.GRAD_BUFFERS})
def finalize_model_grads(ctx: TaskContext[TrainState]) -> None:
    """With megatron-core's DDP (`trainer.dense_ddp=megatron`): its finalize_model_grads, the
    gradient all-reduce, and the reduced gradients as `.grad`. torch DDP already all-reduced the
    dense gradients during backward: nothing to do."""
    state = ctx.state
    if state.training and state.grad_buffers is not None:
        state.grad_buffers.finalize()


@declare_effects("updates the dense parameters and the optimizer state in place")
@task("optimizer_step")
def optimizer_step(ctx: TaskContext[TrainState]) -> None:
    slots, state = ctx.slots, ctx.state
    accumulation = state.grad_accumulation
    if state.training and (
        accumulation is None or accumulation.steps_optimizer(accumulation.micro_step(ctx.batch_index))
    ):
        state.optimizer.step()
    outputs = slots[MODEL_OUT]
    slots.set(
        STEP_RESULT,
        StepResult(
            loss=slots[LOSS].detach(),
            logits=outputs["logits"].detach(),
            labels=outputs["labels"],
            sample_ids=slots[BATCH_GPU].sample_ids,
            global_tokens=slots.get(GLOBAL_TOKENS),
            outputs={k: v.detach() for k, v in outputs.items()},
        ),
    )
