"""Task functions of the plans that start the embedding lookup themselves (torchrec's
TrainPipelineSemiSync and TrainPipelineFusedSparseDist: `pipeline.torchrec_context` semi_sync
or fused).

In those plans the sharded modules' forward (torchrec's `EmbeddingPipelinedForward` /
`InSyncEmbeddingPipelinedForward`) only collects a lookup that `start_embedding_lookup` started
earlier: where that task sits in the plan decides what the lookup sees. One batch ahead and
before the previous batch's backward (semi_sync), the lookup reads the tables from before that
batch's update -- one step stale, declared in the plan by the task's lookahead and
`same_progress_sync`; at lookahead 0 right after the previous backward (fused), it reads the
updated tables and only overlaps the optimizer step.

Like `recsys_pipe.train.tasks`, this module imports no torchrec: the work is done by the state's
`TorchrecSparseDist`; without torchrec tables there is nothing to look up.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field, StrictInt

from recsys_pipe.config.errors import ConfigProblem
from recsys_pipe.config.schema import Section
from recsys_pipe.config.task_registry import Need, task, task_options
from recsys_pipe.engine import TaskContext, declare_effects
from recsys_pipe.train.slots import TORCHREC_CTX
from recsys_pipe.train.state import TrainState

__all__ = [
    "EMBEDDING_LOOKUP",
    "LookupOptions",
    "lookup_coverage_problems",
    "StashOptions",
    "embedding_backward",
    "stash_gradients",
    "start_embedding_lookup",
]

#: the slot start_embedding_lookup writes and forward reads (the started output all-to-alls)
EMBEDDING_LOOKUP = "embedding_lookup"


class LookupOptions(Section):
    """`pipeline.tasks.<lookup task>.options`: which batches this lookup task looks up.

    A semi-synchronous plan with a synchronous warm-up (torchrec's `start_batch`) has two
    lookup tasks: one before the previous batch's backward (stale) for the batches after
    `start_batch`, one after the previous batch's update (fresh) for batches 0..start_batch.
    """

    start_batch: StrictInt | None = Field(
        None,
        ge=0,
        description="the first batch trained semi-synchronously (torchrec's start_batch); null: look up every batch",
    )
    batches: Literal["after", "until"] = Field(
        "after",
        description="with start_batch: after: look up the batches after start_batch; until: batches 0..start_batch",
    )

    def looks_up(self, batch_index: int) -> bool:
        if self.start_batch is None:
            return True
        return (batch_index > self.start_batch) == (self.batches == "after")


def lookup_coverage_problems(tasks: Mapping[str, LookupOptions]) -> list[ConfigProblem]:
    """Problems with the lookup tasks of a plan (`tasks`: name -> options): every batch must be
    looked up by exactly one of them. A batch looked up twice fails inside torchrec ("input_dist
    of ec is not available, probably consumed by others"), a batch looked up by none finds no
    started lookup; so both are plan errors, found when the plan compiles.

    Checking the batches up to the largest `start_batch` + 1 is enough: past it, every task looks
    up every batch or none."""
    if not tasks:
        return []
    last = max((o.start_batch for o in tasks.values() if o.start_batch is not None), default=0) + 1
    for batch in range(last + 1):
        owners = [name for name, options in tasks.items() if options.looks_up(batch)]
        if len(owners) == 1:
            continue
        first = next(iter(tasks))
        settings = "; ".join(f"{name}: {_describe(o)}" for name, o in tasks.items())
        if owners:
            message = f"batch {batch} is looked up by {' and '.join(owners)}, each batch must be looked up once"
        else:
            message = f"batch {batch} is looked up by no lookup task"
        path = f"pipeline.tasks.{owners[0] if owners else first}.options"
        return [
            ConfigProblem(
                path,
                f"{message} ({settings}); give the tasks one start_batch, one batches=after "
                "and the other batches=until",
            )
        ]
    return []


def _describe(options: LookupOptions) -> str:
    if options.start_batch is None:
        return "every batch"
    return f"start_batch={options.start_batch}, batches={options.batches}"


@declare_effects(
    "waits for the batch's input tensors, looks its embeddings up and starts the output all-to-all, "
    "keeping the awaitables in the batch's torchrec context (changed in place)"
)
@task("start_embedding_lookup", needs={Need.SPARSE_DIST}, options=LookupOptions)
def start_embedding_lookup(ctx: TaskContext[TrainState]) -> None:
    """torchrec's `_start_embedding_lookup` for every sharded module of the batch (when
    `options` give it this batch; otherwise another lookup task of the plan does it). Writes
    its declared slot (the started lookup, or None) either way."""
    state = ctx.state
    sparse = state.sparse_dist
    # the run's step: a resumed run does not warm up again, and its first lookup returns what the
    # checkpoint saved of that step's lookup (TorchrecSparseDist.restore_lookups)
    step = state.run_step(ctx.batch_index)
    mine = sparse is not None and task_options(ctx, LookupOptions).looks_up(step)
    result = sparse.start_lookup(ctx.slots[TORCHREC_CTX], step if state.training else None) if mine else None
    for slot in ctx.task.writes:
        ctx.slots.set(slot.name, result)


@declare_effects("back-propagates the detached embeddings' gradients: output all-to-all backward, fused table update")
@task("embedding_backward", needs={Need.SPARSE_DIST})
def embedding_backward(ctx: TaskContext[TrainState]) -> None:
    """semi_sync: forward's backward stopped at the detached embeddings; this pushes their
    gradients through the lookup (torchrec's `TrainPipelineSemiSync.embedding_backward`)."""
    sparse = ctx.state.sparse_dist
    if ctx.state.training and sparse is not None:
        sparse.embedding_backward(ctx.slots[TORCHREC_CTX])


class StashOptions(Section):
    """`pipeline.tasks.stash_gradients.options`."""

    start_batch: StrictInt = Field(
        0, ge=0, description="the first batch whose gradients are stashed (torchrec's start_batch of semi-sync)"
    )


@declare_effects("swaps every parameter's gradient (.grad) with the one kept from the previous batch")
@task("stash_gradients", options=StashOptions)
def stash_gradients(ctx: TaskContext[TrainState]) -> None:
    """semi_sync with stashed gradients (torchrec's `stash_gradients=True`): the optimizer step
    after batch i applies batch i-1's dense gradients, and batch i's are kept for the next step,
    so the dense update is one step stale like the embeddings (torchrec's `_grad_swap`). From
    batch `options.start_batch` on: the first swap finds no kept gradients, so that step changes
    no parameter (torchrec skips it)."""
    state = ctx.state
    if not state.training or state.run_step(ctx.batch_index) < task_options(ctx, StashOptions).start_batch:
        return
    for name, param in state.model.named_parameters():
        kept = state.grad_stash.get(name)
        if param.grad is not None:
            state.grad_stash[name] = param.grad.clone()
        param.grad = kept
