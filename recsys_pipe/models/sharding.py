"""Shard a model's EmbeddingCollection with DistributedModelParallel, and build its optimizer.

The plan is constructed explicitly (`construct_module_sharding_plan`) instead of asking the
planner: it is identical on every rank without a collective (a planner failure inside
`collective_plan` on rank 0 leaves the other ranks hanging), and it can never pick
data_parallel, which is broken for EmbeddingCollection on CPU. Embedding tables get a fused
optimizer applied in backward (fbgemm TBE updates rows during `backward`); the dense rest of
the model is wrapped by DMP's default DDP (works on CPU with gloo).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

SHARDING_TYPES = ("table_wise", "row_wise")


def sharding_plan(
    model: nn.Module, world_size: int, device_type: str, sharding_type: str = "table_wise"
) -> ShardingPlan:
    """Plan for every EmbeddingCollection in `model`: tables round-robin (table_wise) or
    split by rows over all ranks (row_wise)."""
    if sharding_type not in SHARDING_TYPES:
        raise ValueError(f"sharding_type {sharding_type!r} not in {SHARDING_TYPES}")
    plan: dict[str, Any] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, EmbeddingCollection):
            continue
        tables = [cfg.name for cfg in module.embedding_configs()]
        per_table = {
            name: table_wise(rank=i % world_size) if sharding_type == "table_wise" else row_wise()
            for i, name in enumerate(tables)
        }
        plan[fqn] = construct_module_sharding_plan(
            module,
            per_table,
            sharder=EmbeddingCollectionSharder(),
            local_size=world_size,
            world_size=world_size,
            device_type=device_type,
        )
    return ShardingPlan(plan)


def make_sharded_model(
    model: nn.Module,
    pg: dist.ProcessGroup,
    device: torch.device,
    sharding_type: str = "table_wise",
    embedding_optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
    embedding_optimizer_kwargs: Mapping[str, Any] | None = None,
) -> DistributedModelParallel:
    """Wrap `model` (built identically on every rank) in DMP over `pg`.

    `embedding_optimizer` must be one torchrec maps to an fbgemm fused optimizer
    (`torch.optim.SGD`, `Adagrad`, `Adam` or `torchrec.optim.RowWiseAdagrad`).
    Works for world size 1 and up.
    """
    embedding_params = [p for m in model.modules() if isinstance(m, EmbeddingCollection) for p in m.parameters()]
    apply_optimizer_in_backward(embedding_optimizer, embedding_params, dict(embedding_optimizer_kwargs or {"lr": 0.05}))
    return DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(pg),
        device=device,
        plan=sharding_plan(model, pg.size(), device.type, sharding_type),
        sharders=[EmbeddingCollectionSharder()],
    )


def make_optimizer(
    model: DistributedModelParallel,
    dense_optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer] = lambda params: torch.optim.Adam(
        params, lr=1e-3
    ),
) -> CombinedOptimizer:
    """Dense optimizer over the non-embedding parameters combined with DMP's fused embedding
    optimizer, so `zero_grad`/`step` cover the whole model (the fused part's `step` is a
    no-op: its update already happened in backward)."""
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())), dense_optimizer)
    return CombinedOptimizer([model.fused_optimizer, dense])
