"""torchrec's sparse input distribution, driven one step at a time by the task functions.

For a model whose torchrec tables are sharded by `DistributedModelParallel`, the embedding
lookup's input must reach the ranks that hold the rows: torchrec splits that input distribution
off the forward (`_rewrite_model`) so a pipeline can run it batches ahead. `TorchrecSparseDist`
owns the pieces the tasks need -- the per-batch pipeline contexts, the rewritten (pipelined)
modules, and the start / wait / prefetch / bind steps -- so the task functions stay
model-agnostic and torchrec-free: a model with plain torch tables has no `TorchrecSparseDist`
and its input-dist tasks do nothing.

torchrec facts these steps rely on, alike in torchrec 1.6.1 (with torch 2.11, the GPU image's
pairing; scripts/compat_check.sh) and 1.8 (verified on 2 gloo ranks, bitwise against a plain loop
and `TrainPipelineSparseDist`); the private helpers imported below have the same signatures in both:
- contexts are per batch: `_start_data_dist` never clears a v1 context;
- one `PipelinedForward` per sharded module serves every batch, so the forward must
  `set_context` the batch's context first; it pops that batch's input-dist results;
- the public `prefetch_embeddings` returns early without a data_dist stream (always on CPU), so
  `prefetch` calls `_prefetch_embeddings` and fills the two post-prefetch maps itself, as
  torchrec does; `PrefetchPipelinedForward` has no fallback if it did not run;
- on CPU every stream argument is None: a stream makes the forwards `record_stream` CPU tensors;
- the forwards take their device from the data_dist stream and assume CUDA without one, so on
  the CPU `rewrite` sets it (the embedding forwards of semi_sync / fused ask it for its current
  stream); `EmbeddingPipelinedForward` on an EmbeddingBagCollection still records its KeyedTensor
  on that stream, which fails on the CPU (the HSTU model's EmbeddingCollection does not);
- torchrec's own TrainPipelineSemiSync and TrainPipelineFusedSparseDist fail on the CPU: they
  pass the CPU's current stream to `record_stream` (`RuntimeError: unknown parameter type`);
- an `Awaitable`'s `wait()` passes its result through the awaitable's `callbacks`: a lookup a
  checkpoint saved (`restore_lookups`) is put in place by one, when the forward waits for it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torchrec.distributed.train_pipeline.pipeline_context import (
    EmbeddingTrainPipelineContext,
    PrefetchTrainPipelineContext,
    TrainPipelineContext,
)
from torchrec.distributed.train_pipeline.runtime_forwards import (
    EmbeddingPipelinedForward,
    InSyncEmbeddingPipelinedForward,
    PipelinedForward,
    PrefetchPipelinedForward,
)
from torchrec.distributed.train_pipeline.utils import (
    _override_input_dist_forwards,
    _prefetch_embeddings,
    _rewrite_model,
    _start_data_dist,
    _start_embedding_lookup,
)
from torchrec.distributed.types import Awaitable, NoWait
from torchrec.sparse.jagged_tensor import KeyedTensor

from recsys_pipe.engine import StreamPool
from recsys_pipe.models.managed import counting_paused

__all__ = ["CONTEXTS", "TorchrecSparseDist"]

#: `pipeline.torchrec_context` -> torchrec's per-batch context type and the pipelined forward
#: the model rewrite installs (the pair each of torchrec's pipeline classes uses):
#: base: TrainPipelineSparseDist; prefetch: PrefetchTrainPipelineSparseDist;
#: semi_sync: TrainPipelineSemiSync (the lookup is started by a task, its embeddings are
#: detached from forward's graph and get their own backward); fused: TrainPipelineFusedSparseDist
#: (the lookup is started by a task, its gradient flows in the same backward).
CONTEXTS: dict[str, tuple[type[TrainPipelineContext], type]] = {
    "base": (TrainPipelineContext, PipelinedForward),
    "prefetch": (PrefetchTrainPipelineContext, PrefetchPipelinedForward),
    "semi_sync": (EmbeddingTrainPipelineContext, EmbeddingPipelinedForward),
    "fused": (EmbeddingTrainPipelineContext, InSyncEmbeddingPipelinedForward),
}


class TorchrecSparseDist:
    """The input distribution of a DMP model's sharded tables, step by step.

    Args:
        model: the DMP-wrapped model.
        device: the training device.
        streams: the plan's streams (`data_dist`, `default`, and `prefetch` when prefetching).
        context: `pipeline.torchrec_context`, a key of `CONTEXTS`.
    """

    def __init__(self, model: nn.Module, device: torch.device, streams: StreamPool, context: str = "base") -> None:
        self.model = model
        self.device = device
        self.streams = streams
        self.context_kind = context
        self.context_type, self.pipelined_forward = CONTEXTS[context]
        #: torchrec modules whose forward the model rewrite split (set by `rewrite`).
        self.pipelined_modules: list = []
        #: training lookups started and not yet collected by their forward, by the run's step
        self._started: dict[int, EmbeddingTrainPipelineContext] = {}
        #: looked-up values a checkpoint saved, by the run's step: that step's lookup returns them
        self._restored: dict[int, dict[str, list[torch.Tensor]]] = {}
        #: the lookup and forward tasks of different batches may run on different threads
        self._lock = threading.Lock()

    def stream(self, name: str) -> torch.cuda.Stream | None:
        """The CUDA stream torchrec should use, or None on CPU (where a stream would make the
        pipelined forwards call `record_stream` on CPU tensors, which is unsupported)."""
        if not self.streams.is_cuda or name not in self.streams:
            return None
        return self.streams.get(name)

    def new_context(self, index: int) -> TrainPipelineContext:
        """A fresh torchrec v1 context per batch: `_start_data_dist` never clears one."""
        return self.context_type(index=index, version=1)

    @property
    def rewritten(self) -> bool:
        return bool(self.pipelined_modules)

    def rewrite(self, batch: Any, context: TrainPipelineContext) -> Any:
        """Rewrite the model on its first device batch and start that batch's input dist.

        torchrec's rewrite FX-traces the model on a real batch, replaces each sharded module's
        forward by a pipelined one, and needs one input dist started to install the fused splits
        all-to-all. Returns the started splits (the `input_dist_splits` slot of that batch).
        """
        if self.rewritten:
            raise RuntimeError("the model was already rewritten for pipelining")
        modules, model, _, _, not_pipelined = _rewrite_model(
            model=self.model,
            context=context,
            dist_stream=self.stream("data_dist"),
            batch=batch,
            apply_jit=False,
            pipelined_forward=self.pipelined_forward,
            pipeline_postproc=False,
            default_stream=self.stream("default"),
        )
        if not modules or not_pipelined:
            raise RuntimeError(
                f"torchrec could not pipeline the model's sharded modules (pipelined: {len(modules)}, "
                f"not pipelined: {not_pipelined}); their input must be an attribute of the batch"
            )
        if model is not self.model:  # only with apply_jit, which we never ask for
            raise RuntimeError("torchrec's rewrite returned a new model object; views of this state would be stale")
        self.pipelined_modules[:] = modules  # in place: views of the state share the list
        if self.stream("data_dist") is None:
            # torchrec's forwards take their device from the data_dist stream and assume CUDA
            # without one; the embedding forwards (semi_sync, fused) ask that device for its
            # current stream, which must be the CPU's on the CPU
            for module in modules:
                module.forward._device = self.device
        with torch.cuda.stream(self.stream("data_dist")):
            _start_data_dist(modules, batch, context)
        _override_input_dist_forwards(modules)
        if self.streams.is_cuda:  # one-time: later tasks order on events, the rewrite did not
            torch.cuda.synchronize(self.device)
        return context.fused_splits_awaitables

    def start(self, batch: Any, context: TrainPipelineContext) -> Any:
        """torchrec `_start_data_dist`: per-module input dists and the fused splits all-to-all."""
        _start_data_dist(self.pipelined_modules, batch, context)
        return context.fused_splits_awaitables

    def wait(self, context: TrainPipelineContext) -> Any:
        """Wait for the splits; this issues the tensors all-to-all (torchrec's wait_sparse_data_dist)."""
        for names, awaitable in context.fused_splits_awaitables:
            for name, request in zip(names, awaitable.wait()):
                context.input_dist_tensors_requests[name] = request
        context.input_dist_splits_requests.clear()
        context.fused_splits_awaitables.clear()
        return context.input_dist_tensors_requests

    def prefetch(self, context: PrefetchTrainPipelineContext) -> Any:
        """Wait for the input tensors and warm the embedding cache (`module.prefetch`) for the
        batch the next forward trains. CPU kernels have no cache: the wait is the real work."""
        data = _prefetch_embeddings(
            None,  # unused by torchrec: everything comes from the context
            context,
            self.pipelined_modules,
            self.device,
            torch.cuda.stream,
            self.stream("data_dist"),
            self.stream("default"),
        )
        for name, dist_input in data.items():  # what torchrec's public prefetch_embeddings does
            context.module_input_post_prefetch[name] = dist_input
            context.module_contexts_post_prefetch[name] = context.module_contexts.pop(name)
        return context.module_input_post_prefetch

    def bind(self, context: TrainPipelineContext) -> None:
        """Tie the shared pipelined forwards to this batch's context before its forward (which
        collects the batch's lookup, if one was started: it is no longer in flight)."""
        for module in self.pipelined_modules:
            module.forward.set_context(context)
        with self._lock:
            for step, started in list(self._started.items()):
                if started is context:
                    del self._started[step]

    def start_lookup(self, context: EmbeddingTrainPipelineContext, step: int | None = None) -> Any:
        """torchrec's `_start_embedding_lookup` for every pipelined module: wait for the batch's
        input tensors, run the lookup and start the output all-to-all; the awaitables go to
        `context.embedding_a2a_requests`, which the pipelined forward consumes (semi_sync: it
        detaches the embeddings and keeps them for `embedding_backward`).

        `step`: the run's step of a training batch (None for evaluation). Its lookup is in
        flight until the forward collects it (`lookups_in_flight`); if a checkpoint saved this
        step's looked-up values (`restore_lookups`), the lookup returns those instead."""
        if not isinstance(context, EmbeddingTrainPipelineContext):
            raise RuntimeError(
                "start_embedding_lookup needs torchrec's embedding context: set pipeline.torchrec_context "
                f"to semi_sync or fused (it is {self.context_kind})"
            )
        target = self.stream("default")
        with self._lock:
            saved = self._restored.pop(step, None) if step is not None else None
        # a restored lookup runs again on tables that counted its ids already (ids: managed)
        with counting_paused(self.pipelined_modules) if saved is not None else nullcontext():
            for module in self.pipelined_modules:
                _start_embedding_lookup(module, context, self.stream("data_dist"), target, torch.cuda.stream)
        if step is not None:
            with self._lock:
                self._started[step] = context
            if saved is not None:
                _substitute(context, saved, step)
        return context.embedding_a2a_requests

    def lookups_in_flight(self) -> dict[int, dict[str, list[torch.Tensor]]]:
        """The values of the training lookups started for steps not trained yet (a checkpoint's
        share of what is in flight), by the run's step and module: {step: {module: [tensors]}}.

        In the semi-synchronous plans the next batch's lookup reads the tables from before the
        last update, which no checkpoint holds; saving what it returned lets a resumed run train
        that batch on the same embeddings (`restore_lookups`). Each output all-to-all is waited
        for here and its result handed to the forward as is (torchrec's `NoWait`), so the batch
        trains on exactly these tensors."""
        saved: dict[int, dict[str, list[torch.Tensor]]] = {}
        with self._lock:
            started = sorted(self._started.items())
        if started and self.streams.is_cuda:  # the lookups ran on the plan's streams, not this thread's
            torch.cuda.synchronize(self.device)
        for step, context in started:
            modules = {}
            for name, request in list(context.embedding_a2a_requests.items()):
                embeddings, context.embedding_a2a_requests[name] = _settle(request)
                modules[name] = [values.detach().clone() for values in _embedding_values(embeddings)]
            if modules:
                saved[step] = modules
        return saved

    def restore_lookups(self, saved: Mapping[int, Mapping[str, Sequence[torch.Tensor]]]) -> None:
        """Make the lookups of the steps in `saved` (`lookups_in_flight` of a checkpoint) return
        the saved values. The lookup itself still runs: the embeddings' backward goes through it
        to the tables (and their fused optimizer), exactly as in the run that saved them."""
        self._restored = {
            int(step): {name: list(values) for name, values in modules.items()} for step, modules in saved.items()
        }

    def embedding_backward(self, context: EmbeddingTrainPipelineContext) -> None:
        """The embeddings' own backward (semi_sync): the gradients forward's backward left on the
        detached embeddings, pushed into the lookup's graph (output all-to-all backward, fused
        table update). As torchrec's `TrainPipelineSemiSync.embedding_backward`, which is a method
        of the pipeline object; embeddings without a gradient (unused by the loss) are skipped."""
        for tensors, detached in zip(context.embedding_tensors, context.detached_embedding_tensors, strict=True):
            pairs: list[tuple[torch.Tensor, Any]]
            pairs = [
                (t, d.grad) for t, d in zip(tensors, detached, strict=True) if t.numel() == 1 or d.grad is not None
            ]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


class _Substitute(torch.autograd.Function):
    """The saved values in the forward, the looked-up tensor's place in the backward: the
    gradient passes to the fresh lookup unchanged (as it would to the saved lookup's own graph),
    so the tables get the update of the run that saved the values."""

    @staticmethod
    def forward(ctx: Any, looked_up: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        return saved.to(device=looked_up.device).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _settle(request: Any) -> tuple[Any, Any]:
    """Wait for a started lookup (`embedding_a2a_requests` value; a pair of awaitables for
    managed-collision modules) and return its embeddings and an already-done stand-in for it."""
    if isinstance(request, Awaitable):
        result = request.wait()
        return result, NoWait(result)
    results = [awaitable.wait() for awaitable in request]
    return results[0], type(request)(NoWait(r) for r in results)


def _embedding_values(embeddings: Any) -> list[torch.Tensor]:
    """The dense tensors of a lookup's output, the ones torchrec's semi-sync forward detaches:
    one KeyedTensor's values (EmbeddingBagCollection) or every JaggedTensor's (EmbeddingCollection)."""
    if isinstance(embeddings, KeyedTensor):
        return [embeddings.values()]
    return [jt.values() for jt in embeddings.values()]


def _substitute(context: EmbeddingTrainPipelineContext, saved: Mapping[str, list[torch.Tensor]], step: int) -> None:
    """Have the started lookups of `context` return `saved` (one callback per module's
    awaitable, run when the forward waits for it)."""
    for name, values in saved.items():
        request = context.embedding_a2a_requests.get(name)
        if request is None:
            raise RuntimeError(
                f"the checkpoint holds a lookup of module {name} for step {step}, which this model lacks"
            )
        first = request if isinstance(request, Awaitable) else request[0]
        first.callbacks.append(lambda embeddings, name=name, values=values: _replace(embeddings, values, name, step))


def _replace(embeddings: Any, saved: list[torch.Tensor], name: str, step: int) -> Any:
    """Put the saved values in place of the looked-up ones (same shapes: the same batch)."""
    looked_up = _embedding_values(embeddings)
    shapes = [tuple(t.shape) for t in looked_up]
    if shapes != [tuple(t.shape) for t in saved]:
        raise RuntimeError(
            f"the checkpoint's lookup of module {name} for step {step} has shapes {[tuple(t.shape) for t in saved]}, "
            f"this run looks up {shapes}: it trains another batch than the run that saved it"
        )
    replaced = [_Substitute.apply(fresh, value) for fresh, value in zip(looked_up, saved, strict=True)]
    if isinstance(embeddings, KeyedTensor):
        embeddings._values = replaced[0]
    else:
        for jt, values in zip(embeddings.values(), replaced, strict=True):
            jt._values = values
    return embeddings
