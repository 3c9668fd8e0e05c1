"""The training state the task functions share, and the torchrec bootstrap.

Tasks are plain functions `fn(ctx)`; everything they need beyond their batch's slots (model,
optimizer, torchrec's pipelined modules, streams) lives in one `TrainState`, passed to the
engine as the pipeline's `state`. Evaluation reuses the same model through `for_eval()`, a view
whose tasks skip the optimizer work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchrec.distributed.train_pipeline.pipeline_context import (
    PrefetchTrainPipelineContext,
    TrainPipelineContext,
)
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward, PrefetchPipelinedForward
from torchrec.distributed.train_pipeline.utils import (
    _override_input_dist_forwards,
    _rewrite_model,
    _start_data_dist,
)

from recsys_pipe.engine import StreamPool

#: Slots the adapter's tasks use (see conf/pipeline/*.yaml for who reads and writes them).
BATCH_GPU = "batch_gpu"
TORCHREC_CTX = "torchrec_ctx"
INPUT_DIST_SPLITS = "input_dist_splits"
GLOBAL_TOKENS = "global_tokens"


@dataclass
class TrainState:
    """What the tasks share. `training=False` makes forward run without grad and the
    zero_grad/backward/finalize/optimizer tasks do nothing (evaluation)."""

    model: nn.Module
    optimizer: Any
    device: torch.device
    streams: StreamPool
    #: the plan's `pipeline.torchrec_context`: "prefetch" for plans that prefetch embeddings
    torchrec_context: str = "base"
    training: bool = True
    #: called by finalize_model_grads (megatron-core's finalize_model_grads); None with torch
    #: DDP, which all-reduces gradients during backward.
    finalize_grads: Callable[[], None] | None = None
    #: torchrec modules whose forward was split by the model rewrite (set by bootstrap).
    pipelined_modules: list = field(default_factory=list)
    #: `trainer.precision=bf16`: the forward runs under autocast to this dtype
    autocast_dtype: torch.dtype | None = None

    def autocast(self) -> torch.autocast:
        """The forward's autocast context (disabled without `autocast_dtype`). Autocast state is
        per thread, so the task running the forward enters it itself."""
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    @property
    def prefetch(self) -> bool:
        return self.torchrec_context == "prefetch"

    @property
    def context_type(self) -> type:
        return PrefetchTrainPipelineContext if self.prefetch else TrainPipelineContext

    def new_context(self, index: int) -> TrainPipelineContext:
        """A fresh torchrec v1 context per batch: `_start_data_dist` never clears one."""
        return self.context_type(index=index, version=1)

    def stream(self, name: str) -> torch.cuda.Stream | None:
        """The CUDA stream torchrec should use, or None on CPU (where a stream would make the
        pipelined forwards call `record_stream` on CPU tensors, which is unsupported)."""
        if not self.streams.is_cuda or name not in self.streams:
            return None
        return self.streams.get(name)

    def for_eval(self) -> TrainState:
        """The same model, modules and streams, with the optimizer work switched off."""
        return dataclasses.replace(self, training=False)

    @property
    def bootstrapped(self) -> bool:
        return bool(self.pipelined_modules)

    def bootstrap(self, cpu_batch: Any) -> dict[str, Any]:
        """Rewrite the model on the first batch and return that batch's slots.

        torchrec's rewrite FX-traces the model on a real device batch, replaces each sharded
        module's forward by a pipelined one, and needs one input dist started to install the
        fused splits all-to-all. The batch it used is not thrown away: its slots (device batch,
        context, started input dist) seed the engine's ring so it is trained like any other.
        """
        if self.bootstrapped:
            raise RuntimeError("the model was already rewritten for pipelining")
        batch = cpu_batch.to(self.device, non_blocking=True)
        context = self.new_context(0)
        modules, model, _, _, not_pipelined = _rewrite_model(
            model=self.model,
            context=context,
            dist_stream=self.stream("data_dist"),
            batch=batch,
            apply_jit=False,
            pipelined_forward=PrefetchPipelinedForward if self.prefetch else PipelinedForward,
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
        self.pipelined_modules[:] = modules  # in place: views made by for_eval() share the list
        with torch.cuda.stream(self.stream("data_dist")):
            _start_data_dist(modules, batch, context)
        _override_input_dist_forwards(modules)
        if self.streams.is_cuda:  # one-time: later tasks order on events, the bootstrap did not
            torch.cuda.synchronize(self.device)
        return {
            "batch_cpu": cpu_batch,
            BATCH_GPU: batch,
            TORCHREC_CTX: context,
            INPUT_DIST_SPLITS: context.fused_splits_awaitables,
        }
