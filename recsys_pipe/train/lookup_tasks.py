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

from recsys_pipe.config.task_registry import Need, task
from recsys_pipe.engine import TaskContext, declare_effects
from recsys_pipe.train.slots import TORCHREC_CTX
from recsys_pipe.train.state import TrainState

__all__ = ["EMBEDDING_LOOKUP", "embedding_backward", "stash_gradients", "start_embedding_lookup"]

#: the slot start_embedding_lookup writes and forward reads (the started output all-to-alls)
EMBEDDING_LOOKUP = "embedding_lookup"


@declare_effects(
    "waits for the batch's input tensors, looks its embeddings up and starts the output all-to-all, "
    "keeping the awaitables in the batch's torchrec context (changed in place)"
)
@task("start_embedding_lookup", needs={Need.SPARSE_DIST})
def start_embedding_lookup(ctx: TaskContext[TrainState]) -> None:
    """torchrec's `_start_embedding_lookup` for every sharded module of the batch."""
    sparse = ctx.state.sparse_dist
    ctx.slots.set(EMBEDDING_LOOKUP, sparse.start_lookup(ctx.slots[TORCHREC_CTX]) if sparse is not None else None)


@declare_effects("back-propagates the detached embeddings' gradients: output all-to-all backward, fused table update")
@task("embedding_backward", needs={Need.SPARSE_DIST})
def embedding_backward(ctx: TaskContext[TrainState]) -> None:
    """semi_sync: forward's backward stopped at the detached embeddings; this pushes their
    gradients through the lookup (torchrec's `TrainPipelineSemiSync.embedding_backward`)."""
    sparse = ctx.state.sparse_dist
    if ctx.state.training and sparse is not None:
        sparse.embedding_backward(ctx.slots[TORCHREC_CTX])


@declare_effects("swaps every parameter's gradient (.grad) with the one kept from the previous batch")
@task("stash_gradients")
def stash_gradients(ctx: TaskContext[TrainState]) -> None:
    """semi_sync with stashed gradients (torchrec's `stash_gradients=True`): the optimizer step
    after batch i applies batch i-1's dense gradients, and batch i's are kept for the next step,
    so the dense update is one step stale like the embeddings (torchrec's `_grad_swap`; the first
    step has no kept gradients and changes no parameter)."""
    state = ctx.state
    if not state.training:
        return
    for name, param in state.model.named_parameters():
        kept = state.grad_stash.get(name)
        if param.grad is not None:
            state.grad_stash[name] = param.grad.clone()
        param.grad = kept
