"""Build what the task functions run on: the distributed model with its optimizer, and the
`TrainState` for a compiled plan.

The model's config class decides the distribution (see `recsys_pipe.models.base`): a
`ShardedModelConfig` model's torchrec tables are sharded by `DistributedModelParallel`
(`model.sharding`), with the embedding optimizer fused into their backward; a plain
`ModelConfig` model is replicated under DDP and needs no torchrec (imported only for the sharded
path): torch's, or megatron-core's with `trainer.dense_ddp=megatron` (`recsys_pipe.train.dense_ddp`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recsys_pipe._removed import removed_names
from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem
from recsys_pipe.config.task_registry import Need
from recsys_pipe.data.spec import DataSpec
from recsys_pipe.engine import StreamPool
from recsys_pipe.models.base import ShardedModelConfig
from recsys_pipe.runtime.distributed import DistInfo
from recsys_pipe.train.config import RunConfig
from recsys_pipe.train.dense_ddp import MegatronGrads, check_dense_ddp, megatron_ddp
from recsys_pipe.train.optim import dense_optimizer_factory, sparse_optimizer
from recsys_pipe.train.state import TrainState

__all__ = ["build_model", "build_state", "describe_model"]


def _has_torchrec_tables(model: nn.Module) -> bool:
    """Without importing torchrec: its table modules can only exist once torchrec loaded them."""
    tables = sys.modules.get("torchrec.modules.embedding_modules")
    if tables is None:
        return False
    kinds = (tables.EmbeddingCollection, tables.EmbeddingBagCollection)
    return any(isinstance(m, kinds) for m in model.modules())


def build_model(run: RunConfig, info: DistInfo, spec: DataSpec) -> tuple[nn.Module, Any]:
    """The configured model, distributed over the process group, and its optimizer; the same
    initial weights on every rank (seeded)."""
    from recsys_pipe.pp.config import is_pipelined

    if is_pipelined(run):  # parallel.pp: this rank's stages, one module (recsys_pipe.pp.train)
        from recsys_pipe.pp.train import build_pipelined_model

        return build_pipelined_model(run, info, spec)
    check_dense_ddp(run, info.device.type)
    torch.manual_seed(run.seed)
    module = run.model.build(spec)
    dense_factory = dense_optimizer_factory(run.optimizer)
    if isinstance(run.model, ShardedModelConfig):
        from recsys_pipe.models.sharding import make_optimizer, make_sharded_model

        embedding_opt, embedding_kwargs = sparse_optimizer(run.optimizer.sparse)
        model = make_sharded_model(
            module,
            run.model,
            dist.group.WORLD,
            info.device,
            batch_size=run.data.batch_size,
            embedding_optimizer=embedding_opt,
            embedding_optimizer_kwargs=embedding_kwargs,
        )
        return model, make_optimizer(model, dense_factory)
    if _has_torchrec_tables(module):
        raise ConfigError(
            ConfigProblem(
                "model.builder",
                f"model '{run.model.label}' has torchrec embedding tables but a plain ModelConfig: annotate its "
                "builder's config parameter with ShardedModelConfig (or a subclass) so the tables are sharded",
            )
        )
    module = module.to(info.device)
    if run.trainer.dense_ddp == "megatron":
        model = megatron_ddp(module)
    else:
        model = DistributedDataParallel(module, device_ids=[info.device] if info.device.type == "cuda" else None)
    return model, dense_factory(model.parameters())


def build_state(run: RunConfig, plan: CompiledPlan, model: nn.Module, optimizer: Any, info: DistInfo) -> TrainState:
    """The state the plan's tasks share: streams, torchrec's input distribution (sharded
    tables), the balancer (when a task of the plan needs it: `Need.BALANCER`), megatron-core's
    gradient buffers (`trainer.dense_ddp=megatron`)."""
    streams = StreamPool.create(plan.schedule.stream_slots, info.device)
    from recsys_pipe.pp.config import is_pipelined

    sparse_dist = None
    if isinstance(run.model, ShardedModelConfig) and not is_pipelined(run):  # pipelined: plain tables
        from recsys_pipe.train.sparse_dist import TorchrecSparseDist

        sparse_dist = TorchrecSparseDist(model, info.device, streams, context=plan.config.torchrec_context)
    balancer = None
    if plan.needing(Need.BALANCER):
        from recsys_pipe.train.shuffle import BatchBalancer

        balancer = BatchBalancer(run.model.sample_costs)
    return TrainState(
        model=model,
        optimizer=optimizer,
        device=info.device,
        streams=streams,
        sparse_dist=sparse_dist,
        balancer=balancer,
        grad_buffers=MegatronGrads(model) if run.trainer.dense_ddp == "megatron" else None,
        autocast_dtype=torch.bfloat16 if run.trainer.precision == "bf16" else None,
    )


def describe_model(run: RunConfig, plan: CompiledPlan, world_size: int, local_size: int, device_type: str) -> str:
    """What `recsys-plan` shows about the model: how its tables are distributed (for torchrec
    tables, torchrec's printout of the sharding plan for this topology) and which tasks of the
    plan have nothing to do for it. The model is built on the meta device: no table memory."""
    from recsys_pipe.train.plan import idle_tasks

    lines = []
    if isinstance(run.model, ShardedModelConfig):
        from recsys_pipe.models.sharding import optimize_tables_in_backward, sharding_plan

        spec = run.data.spec()
        with torch.device("meta"):
            module = run.model.build(spec)
        if run.model.compute_kernel == "fused":  # as in training
            optimize_tables_in_backward(module, *sparse_optimizer(run.optimizer.sparse))
        sharding = sharding_plan(module, run.model, world_size, device_type, local_size, batch_size=run.data.batch_size)
        lines.append(
            f"model: {run.model.label} (torchrec tables, model.sharding={run.model.sharding}; sharding plan for "
            f"{world_size} rank(s), {local_size} per host, on {device_type})"
        )
        lines.append(str(sharding).strip("\n"))
    elif run.trainer.dense_ddp == "megatron":
        lines.append(
            f"model: {run.model.label} (plain torch tables, replicated on every rank under megatron-core's DDP; "
            "gradients all-reduced by finalize_model_grads)"
        )
    else:
        lines.append(f"model: {run.model.label} (plain torch tables, replicated on every rank under DDP)")
    idle = idle_tasks(plan, run)
    if idle:
        lines.append("tasks with nothing to do in this run:")
        lines += [f"  {name}: {reason}" for name, reason in idle.items()]
    return "\n".join(lines)


__getattr__ = removed_names(
    __name__,
    {"SHUFFLE_FN": "tasks declare what they need (@task(..., needs={Need.BALANCER})); use plan.needing(Need.BALANCER)"},
)
