"""The recommendation-training task functions, one per stage of a torchrec step.

Each is `fn(ctx)` over its batch's slots (`ctx.slots`) and the shared `TrainState`
(`ctx.state`), built on torchrec's own pipeline machinery. Plans in conf/pipeline/ reference
them by import path; the same functions serve the serial and the pipelined plans.

torchrec 1.8 facts these functions rely on (verified on 2 gloo ranks, bitwise against a plain
loop and `TrainPipelineSparseDist`):
- contexts are per batch: `_start_data_dist` never clears a v1 context;
- one `PipelinedForward` per sharded module serves every batch, so `forward` must
  `set_context` the batch's context first; it pops that batch's input-dist results;
- `forward` issues a collective (the embedding output all-to-all), hence `nccl: true`;
- the public `prefetch_embeddings` returns early without a data_dist stream (always on CPU),
  so `prefetch_embeddings` calls `_prefetch_embeddings` and fills the two post-prefetch maps
  itself, as torchrec does; `PrefetchPipelinedForward` has no fallback if it did not run;
- on CPU every stream argument is None: a stream makes the forwards `record_stream` CPU tensors.

Effects outside the slots are declared (`declare_effects`) so that shortcut replay (exposed-time
profiling) skips only what it can replay: `h2d` (its replay hands out a fresh torchrec context)
and `global_tokens_allreduce` (slots only). The others change torchrec's per-batch context in
place (one-shot awaitables of in-flight collectives), module state, the embedding cache,
gradients or parameters, which no capture/restore can replay without doing the work itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline.utils import _prefetch_embeddings, _start_data_dist

from recsys_pipe.engine import DeclaredIO, TaskContext, declare_effects
from recsys_pipe.train.state import BATCH_GPU, GLOBAL_TOKENS, INPUT_DIST_SPLITS, TORCHREC_CTX

__all__ = [
    "StepResult",
    "backward",
    "finalize_model_grads",
    "forward",
    "global_tokens_allreduce",
    "h2d",
    "optimizer_step",
    "prefetch_embeddings",
    "start_input_dist",
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

    @property
    def num_samples(self) -> int:
        return int(self.sample_ids.numel())


def _fresh_context(ctx: TaskContext, _: None) -> None:
    """Replay of h2d: the recorded device batch (later tasks only read it), a new context."""
    ctx.slots.set(TORCHREC_CTX, ctx.state.new_context(ctx.batch_index))


@declare_effects(
    "creates the batch's torchrec context, which the input-dist, prefetch and forward tasks fill and empty in place",
    DeclaredIO(capture=lambda ctx: None, restore=_fresh_context),
)
def h2d(ctx: TaskContext) -> None:
    """batch_cpu -> batch_gpu on the memcpy stream, plus the batch's torchrec context."""
    slots, state = ctx.slots, ctx.state
    if BATCH_GPU in slots:  # the bootstrap batch: moved already
        return
    batch = slots["batch_cpu"].to(state.device, non_blocking=True)
    if state.streams.is_cuda:  # the caching allocator must not recycle it while others read it
        for name in state.streams.names:
            if name != ctx.task.stream:
                batch.record_stream(state.streams.get(name))
    slots.set(BATCH_GPU, batch)
    slots.set(TORCHREC_CTX, state.new_context(ctx.batch_index))


@declare_effects(
    "starts the input all-to-alls and keeps their one-shot awaitables in the batch's torchrec context "
    "(changed in place)"
)
def start_input_dist(ctx: TaskContext) -> None:
    """torchrec `_start_data_dist`: per-module input dists and the fused splits all-to-all."""
    slots, state = ctx.slots, ctx.state
    if INPUT_DIST_SPLITS in slots:  # the bootstrap batch: started by the model rewrite
        return
    context = slots[TORCHREC_CTX]
    _start_data_dist(state.pipelined_modules, slots[BATCH_GPU], context)
    slots.set(INPUT_DIST_SPLITS, context.fused_splits_awaitables)


@declare_effects(
    "waits for the input splits and starts the tensors all-to-all, moving one-shot awaitables within "
    "the batch's torchrec context (changed in place)"
)
def wait_input_dist(ctx: TaskContext) -> None:
    """Wait for the splits; this issues the tensors all-to-all (torchrec's wait_sparse_data_dist)."""
    context = ctx.slots[TORCHREC_CTX]
    for names, awaitable in context.fused_splits_awaitables:
        for name, request in zip(names, awaitable.wait()):
            context.input_dist_tensors_requests[name] = request
    context.input_dist_splits_requests.clear()
    context.fused_splits_awaitables.clear()
    ctx.slots.set("input_dist_tensors", context.input_dist_tensors_requests)


@declare_effects(
    "moves the batch's input-dist results within its torchrec context (changed in place) and warms "
    "the embedding cache that forward reads"
)
def prefetch_embeddings(ctx: TaskContext) -> None:
    """Wait for the input tensors and warm the embedding cache (`module.prefetch`) for the
    batch the next forward will train. CPU kernels have no cache: the wait is the real work."""
    slots, state = ctx.slots, ctx.state
    context = slots[TORCHREC_CTX]
    data = _prefetch_embeddings(
        slots[BATCH_GPU],
        context,
        state.pipelined_modules,
        state.device,
        torch.cuda.stream,
        state.stream("data_dist"),
        state.stream("default"),
    )
    for name, dist_input in data.items():  # what torchrec's public prefetch_embeddings does
        context.module_input_post_prefetch[name] = dist_input
        context.module_contexts_post_prefetch[name] = context.module_contexts.pop(name)
    slots.set("prefetched_input", context.module_input_post_prefetch)


@declare_effects("clears every parameter's gradient (.grad), which backward accumulates into")
def zero_grad(ctx: TaskContext) -> None:
    if ctx.state.training:
        ctx.state.optimizer.zero_grad()


def global_tokens_allreduce(ctx: TaskContext) -> None:
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
def forward(ctx: TaskContext) -> None:
    """model(batch) through the rewritten forward: the embedding lookup uses this batch's
    already distributed input (`set_context` ties the shared pipelined forwards to it). With a
    `global_tokens` slot (global-token normalisation) the loss is the model's `loss_sum` times the
    world size over all ranks' tokens, so DDP's average over ranks gives the global mean."""
    slots, state = ctx.slots, ctx.state
    for module in state.pipelined_modules:
        module.forward.set_context(slots[TORCHREC_CTX])
    with torch.set_grad_enabled(state.training):  # grad mode is per thread: set it explicitly
        loss, aux = state.model(slots[BATCH_GPU])
        tokens = slots.get(GLOBAL_TOKENS)
        if tokens is not None:  # normalise by all ranks' tokens; DDP then averages over ranks
            world = dist.get_world_size() if dist.is_initialized() else 1
            loss = aux["loss_sum"] * world / tokens.squeeze(0)
    slots.set("loss", loss)
    slots.set("model_out", aux)


@declare_effects(
    "accumulates parameter gradients, updates the fused embedding tables and their optimizer state, "
    "all-reduces dense gradients (DDP)"
)
def backward(ctx: TaskContext) -> None:
    """loss.backward(): output-dist backward, fused embedding update, DDP all-reduce."""
    if ctx.state.training:
        ctx.slots["loss"].backward()


@declare_effects("finalizes the dense gradients in place (megatron-core DDP)")
def finalize_model_grads(ctx: TaskContext) -> None:
    """megatron-core's finalize_model_grads when that DDP is used; torch DDP already
    all-reduced the dense gradients during backward."""
    state = ctx.state
    if state.training and state.finalize_grads is not None:
        state.finalize_grads()


@declare_effects("updates the dense parameters and the optimizer state in place")
def optimizer_step(ctx: TaskContext) -> None:
    slots, state = ctx.slots, ctx.state
    if state.training:
        state.optimizer.step()
    aux = slots["model_out"]
    slots.set(
        "step_result",
        StepResult(
            loss=slots["loss"].detach(),
            logits=aux["logits"].detach(),
            labels=aux["labels"],
            sample_ids=slots[BATCH_GPU].sample_ids,
            global_tokens=slots.get(GLOBAL_TOKENS),
        ),
    )
