"""How the replicated (dense) part of a model is data parallel: `trainer.dense_ddp`.

* `torch`: torch's `DistributedDataParallel` all-reduces the gradients during backward, bucket by
  bucket as they fill, into each parameter's `.grad`. The `zero_grad` and `finalize_model_grads`
  tasks have nothing extra to do.
* `megatron`: megatron-core's `DistributedDataParallel`. During backward every gradient is added
  into one contiguous buffer per dtype (`param.main_grad` is a view of it), which megatron-core
  allocates on `torch.cuda.current_device()`: CUDA only. The plan's `finalize_model_grads` task
  all-reduces the buffer (megatron-core's `finalize_model_grads`, the mean over ranks like torch
  DDP) and points each parameter's `.grad` at its slice, so the configured torch optimizer steps
  on it; the `zero_grad` task resets the buffer. Model parallelism is off: megatron-core's
  `parallel_state` with tensor- and pipeline-parallel size 1, so the data-parallel group is the
  whole world. The all-reduce runs in `finalize_model_grads`, not during backward
  (`overlap_grad_reduce=False`): where it runs is the plan's decision.

megatron is offered for models with plain torch tables (a plain `ModelConfig`, such as
`model=dlrm_torch`), wrapped whole. A torchrec-sharded model is refused: `DistributedModelParallel`
wraps its dense part itself, and although it accepts a custom `data_parallel_wrapper`, that
wrapper must wrap DMP's whole module tree while leaving out the sharded tables' parameters, which
megatron-core's DDP cannot do (it takes every trainable parameter of the module it wraps); it would
have to wrap each dense sub-module separately, which is model specific, and no machine available
to this project runs both torchrec (CPU only here) and megatron-core's DDP (CUDA only) to verify it.
"""

from __future__ import annotations

import threading
import warnings
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING

from torch import nn

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.models.base import ShardedModelConfig

if TYPE_CHECKING:
    from recsys_pipe.train.config import RunConfig

__all__ = ["MegatronGrads", "check_dense_ddp", "megatron_ddp"]

PATH = "trainer.dense_ddp"


def check_dense_ddp(run: RunConfig, device_type: str) -> None:
    """Raise ConfigError (path `trainer.dense_ddp`) if the run's dense data parallelism cannot train
    it on `device_type` ("cpu" or "cuda": where the run trains) here. Both CLIs call it before any
    process group starts; `build_model` calls it again for programmatic use."""
    if run.trainer.dense_ddp == "torch":
        return
    problems = []
    if isinstance(run.model, ShardedModelConfig):
        problems.append(
            ConfigProblem(
                PATH,
                f"megatron wraps models with plain torch tables (such as model=dlrm_torch); model "
                f"'{run.model.label}' has torchrec-sharded tables, whose dense part DistributedModelParallel wraps "
                "in torch DDP: megatron-core's DDP cannot leave the sharded tables' parameters out, so this is not "
                "supported; use trainer.dense_ddp=torch",
            )
        )
    if device_type != "cuda":
        where = (
            "trainer.device=cpu" if run.trainer.device == "cpu" else "trainer.device=auto and no CUDA device is visible"
        )
        problems.append(
            ConfigProblem(
                PATH,
                "megatron needs CUDA: megatron-core's DistributedDataParallel keeps its gradient buffers on the GPU, "
                f"and this run trains on the CPU ({where}); use trainer.dense_ddp=torch",
            )
        )
    if not problems:
        try:
            _megatron()
        except ImportError as exc:
            problems.append(
                ConfigProblem(
                    PATH,
                    f"megatron-core cannot be imported here ({exc}); install megatron-core (0.16.1 is tested) or use "
                    "trainer.dense_ddp=torch",
                )
            )
    if problems:
        raise ConfigError(problems)


def megatron_ddp(module: nn.Module) -> nn.Module:
    """`module` (on this rank's GPU) under megatron-core's `DistributedDataParallel` over the whole
    process group, its parameters broadcast from rank 0 (as torch DDP does at construction).

    Initializes megatron-core's `parallel_state` with tensor- and pipeline-parallel size 1 unless it
    is initialized already (then with those sizes); `MegatronGrads(model).close()` gives that back
    (the last one destroys what this module initialized)."""
    mc = _megatron()
    _MODEL_PARALLEL.acquire(mc.parallel_state)
    try:
        model = mc.DistributedDataParallel(
            # megatron-core's DDP and finalize_model_grads read their switches from a TransformerConfig
            # (calculate_per_token_loss, the MoE router flags, timers); its constructor requires a
            # transformer's shape, which describes nothing here. cuda_graph_scope=[] is the
            # current spelling of its default (the default "full" warns that it is deprecated).
            config=mc.TransformerConfig(num_layers=1, hidden_size=1, num_attention_heads=1, cuda_graph_scope=[]),
            ddp_config=mc.DistributedDataParallelConfig(
                overlap_grad_reduce=False,  # all-reduce in the finalize_model_grads task, where the plan puts it
                use_distributed_optimizer=False,  # every rank's torch optimizer holds the whole state
                grad_reduce_in_fp32=False,  # gradients in the parameters' dtype, as with torch DDP
            ),
            module=module,
        )
        model.broadcast_params()
    except BaseException:
        _MODEL_PARALLEL.release(mc.parallel_state)
        raise
    return model


class MegatronGrads:
    """The gradient buffers of a `megatron_ddp` model, as the tasks use them (`TrainState.grad_buffers`):
    `reset` in `zero_grad`, `finalize` in `finalize_model_grads`, `close` when training ends."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._finalize_model_grads = _megatron().finalize_model_grads
        self._closed = False

    def reset(self) -> None:
        """Before the step's forward: zero the buffer, and leave no parameter a `.grad`: a stale
        view of the buffer would make autograd accumulate into the buffer in place and megatron's
        hook add the result to it a second time."""
        for param in self._params:
            param.grad = None
        self.model.zero_grad_buffer()

    def finalize(self) -> None:
        """After backward, before the optimizer step: megatron-core's finalize_model_grads (the
        buffer all-reduced over the data-parallel group, scaled to the mean), then each
        parameter's slice of the buffer becomes its `.grad` (no copy), as megatron-core's own
        optimizer wrapper does before its step; the configured torch optimizer steps on it."""
        self._finalize_model_grads([self.model])
        for param in self._params:
            param.grad = param.main_grad

    def close(self) -> None:
        """Give back the model-parallel state `megatron_ddp` took (once)."""
        if not self._closed:
            self._closed = True
            _MODEL_PARALLEL.release(_megatron().parallel_state)


class _ModelParallelState:
    """megatron-core's `parallel_state` is process global: initialized by the first `megatron_ddp`
    (unless something else initialized it), destroyed when the last model built on it is closed,
    so models built one after another in one process (tests, parity runs) each find it ready."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._owned = False

    def acquire(self, parallel_state: ModuleType) -> None:
        with self._lock:
            if self._users == 0:
                if parallel_state.model_parallel_is_initialized():
                    sizes = (
                        parallel_state.get_tensor_model_parallel_world_size(),
                        parallel_state.get_pipeline_model_parallel_world_size(),
                    )
                    if sizes != (1, 1):
                        raise RuntimeError(
                            f"megatron-core's parallel_state is initialized with tensor/pipeline-parallel sizes "
                            f"{sizes}; trainer.dense_ddp=megatron is data parallel only (sizes 1 and 1)"
                        )
                    self._owned = False
                else:
                    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
                    self._owned = True
            self._users += 1

    def release(self, parallel_state: ModuleType) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._owned:
                parallel_state.destroy_model_parallel()
                self._owned = False


_MODEL_PARALLEL = _ModelParallelState()


def _megatron() -> SimpleNamespace:
    """The megatron-core names used here, imported on first use (seconds; only for dense_ddp=megatron).
    Without Transformer Engine or Apex megatron-core warns at import that it falls back to plain
    torch kernels, and its inference package warns about its own imports; neither concerns what is
    used here, so those warnings are not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\.")
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.transformer.transformer_config import TransformerConfig
    return SimpleNamespace(
        parallel_state=parallel_state,
        DistributedDataParallel=DistributedDataParallel,
        DistributedDataParallelConfig=DistributedDataParallelConfig,
        finalize_model_grads=finalize_model_grads,
        TransformerConfig=TransformerConfig,
    )
