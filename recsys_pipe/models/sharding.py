"""Shard a model's torchrec tables with DistributedModelParallel, and build its optimizer.

The sharding plan (`model.sharding`) covers every `EmbeddingCollection` and
`EmbeddingBagCollection` of the model:

* `table_wise`: whole tables round-robin over the ranks; `row_wise`: every table split by rows
  over all ranks. Constructed directly (`construct_module_sharding_plan`).
* `planner`: torchrec's `EmbeddingShardingPlanner` for the real topology -- world size, the
  ranks per host (`LOCAL_WORLD_SIZE`, as torchrun sets it) and the compute device -- with the
  per-table `model.sharding_constraints`.

Every rank computes the same plan itself, with no collective. torchrec's `collective_plan`
plans on rank 0 and broadcasts, so a planner failure there leaves the other ranks waiting in
the broadcast; planning everywhere makes a failure happen on every rank alike, and each exits
with the planner's message as a config error. (The planner is deterministic given the model,
topology and constraints: it does not read the devices.)

data_parallel `EmbeddingCollection` tables do not work on CPU in torchrec, so on CPU the planner
is not offered that choice and a constraint asking for it is refused.

`model.compute_kernel` picks torchrec's kernel for every table: `fused` (default) fuses the table
optimizer (`optimizer.sparse`) into the backward (fbgemm updates rows during `backward`);
`dense` gives the tables ordinary gradients, so the dense optimizer updates them with the rest of
the model (e.g. Adam, which fbgemm does not fuse on CPU). The dense kernel comes with the
hand-built plans only: torchrec's planner offers it for data_parallel tables alone. The dense
rest of the model is wrapped by DMP's default DDP (works on CPU with gloo); the sharded tables
are not part of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory
from torchrec.distributed.planner.types import TrainerConfig as PlannerTrainerConfig
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.data.batch import register_with_torchrec
from recsys_pipe.models.base import ShardedModelConfig

__all__ = [
    "embedding_modules",
    "has_torchrec_tables",
    "local_world_size",
    "make_optimizer",
    "make_sharded_model",
    "optimize_tables_in_backward",
    "sharding_plan",
]

register_with_torchrec()  # our batches are torchrec Pipelineables wherever torchrec shards a model

#: fraction of each device's memory the planner leaves for everything but the tables
STORAGE_RESERVATION = 0.15


def _sharder(module: nn.Module) -> ModuleSharder:
    return EmbeddingCollectionSharder() if isinstance(module, EmbeddingCollection) else EmbeddingBagCollectionSharder()


def embedding_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The torchrec tables' modules of `model` by qualified name (`EmbeddingCollection`s and
    `EmbeddingBagCollection`s)."""
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, (EmbeddingCollection, EmbeddingBagCollection))}


def has_torchrec_tables(model: nn.Module) -> bool:
    return bool(embedding_modules(model))


def _tables(module: nn.Module) -> list[str]:
    configs = module.embedding_configs() if isinstance(module, EmbeddingCollection) else module.embedding_bag_configs()
    return [cfg.name for cfg in configs]


def local_world_size(world_size: int) -> int:
    """Ranks on this host: `LOCAL_WORLD_SIZE` as torchrun sets it; `world_size` (one host) when
    the process was not started by torchrun."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def sharding_plan(
    model: nn.Module,
    cfg: ShardedModelConfig,
    world_size: int,
    device_type: str,
    local_size: int | None = None,
    batch_size: int = 512,
) -> ShardingPlan:
    """The plan `cfg.sharding` gives `model`'s tables.

    Args:
        model: the unsharded model.
        cfg: the model's config (`sharding`, `sharding_constraints`, `compute_kernel`).
        world_size: the number of ranks.
        device_type: `cpu` or `cuda`.
        local_size: ranks per host (default: `local_world_size(world_size)`).
        batch_size: the per-rank batch size, for the planner's estimates.

    Returns:
        torchrec's `ShardingPlan`. Raises ConfigError (at `model.sharding` /
        `model.sharding_constraints.<table>`) when the choice cannot work: a sharding type torchrec
        does not offer for the table on this device, a constraint naming no table, or a planner
        failure (with the planner's message)."""
    local_size = local_world_size(world_size) if local_size is None else local_size
    modules = embedding_modules(model)
    if cfg.sharding == "planner":
        return _planner_plan(model, modules, cfg, world_size, local_size, device_type, batch_size)
    plan: dict[str, Any] = {}
    position = 0
    for fqn, module in modules.items():
        sharder = _sharder(module)
        offered = sharder.sharding_types(device_type)
        if cfg.sharding not in offered:
            raise ConfigError(
                ConfigProblem(
                    "model.sharding",
                    f"{cfg.sharding} is not offered by torchrec's {type(sharder).__name__} on {device_type} "
                    f"(module '{fqn}'); it offers {', '.join(offered)}: use model.sharding=planner, with "
                    "model.sharding_constraints to choose per table",
                )
            )
        per_table = {}
        for name in _tables(module):
            kernel = cfg.compute_kernel
            per_table[name] = (
                table_wise(rank=position % world_size, compute_kernel=kernel)
                if cfg.sharding == "table_wise"
                else row_wise(compute_kernel=kernel)
            )
            position += 1
        plan[fqn] = construct_module_sharding_plan(
            module,
            per_table,
            sharder=sharder,
            local_size=local_size,
            world_size=world_size,
            device_type=device_type,
        )
    return ShardingPlan(plan)


def _planner_plan(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    cfg: ShardedModelConfig,
    world_size: int,
    local_size: int,
    device_type: str,
    batch_size: int,
) -> ShardingPlan:
    tables = {name: module for module in modules.values() for name in _tables(module)}
    problems = [
        ConfigProblem(
            f"model.sharding_constraints.{name}", f"no table '{name}' in the model (tables: {', '.join(tables)})"
        )
        for name in cfg.sharding_constraints
        if name not in tables
    ]
    constraints: dict[str, ParameterConstraints] = {}
    for name, module in tables.items():
        allowed = list(cfg.sharding_constraints.get(name, []))
        if isinstance(module, EmbeddingCollection) and device_type == "cpu":
            if "data_parallel" in allowed:
                problems.append(
                    ConfigProblem(
                        f"model.sharding_constraints.{name}",
                        "data_parallel does not work for EmbeddingCollection tables on CPU (torchrec's data-parallel "
                        "EmbeddingCollection fails there); allow row_wise, column_wise or table_wise",
                    )
                )
            elif not allowed:  # keep the planner from choosing it on its own
                allowed = [t for t in EmbeddingCollectionSharder().sharding_types("cpu") if t != "data_parallel"]
        if allowed:
            constraints[name] = ParameterConstraints(sharding_types=allowed)
    if problems:
        raise ConfigError(problems)
    topology = TopologyFactory.create_topology(
        PlannerTrainerConfig(world_size=world_size, local_world_size=local_size),
        kernel_config=KernelConfig(compute_device=device_type),
    )
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(STORAGE_RESERVATION),
        debug=False,
    )
    sharders = list({type(s): s for s in (_sharder(m) for m in modules.values())}.values())
    try:
        return planner.plan(model, sharders)
    except Exception as exc:  # any planner failure: every rank reports it the same way and exits
        raise ConfigError(ConfigProblem("model.sharding", f"torchrec's planner found no plan: {exc}")) from None


def optimize_tables_in_backward(
    model: nn.Module,
    embedding_optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
    embedding_optimizer_kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Fuse `embedding_optimizer` into the backward of every torchrec table of `model`. Done
    before planning: a table with an optimizer in backward gets torchrec's fused kernel."""
    params = [p for m in embedding_modules(model).values() for p in m.parameters()]
    apply_optimizer_in_backward(embedding_optimizer, params, dict(embedding_optimizer_kwargs or {"lr": 0.05}))


def make_sharded_model(
    model: nn.Module,
    cfg: ShardedModelConfig,
    pg: dist.ProcessGroup,
    device: torch.device,
    batch_size: int = 512,
    embedding_optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
    embedding_optimizer_kwargs: Mapping[str, Any] | None = None,
    data_parallel: bool = True,
) -> DistributedModelParallel:
    """Wrap `model` in DistributedModelParallel over `pg`, its tables sharded by `cfg.sharding` on
    `cfg.compute_kernel`. Works for world size 1 and up.

    Args:
        model: the model, built identically on every rank.
        cfg: the model's config (`sharding`, `sharding_constraints`, `compute_kernel`).
        pg: the process group the tables are sharded over.
        device: this rank's device.
        batch_size: the per-rank batch size, for torchrec's planner's estimates.
        embedding_optimizer: the optimizer fused into the tables' backward (fused kernel only);
            one torchrec maps to an fbgemm fused optimizer (`torch.optim.SGD`, `Adagrad`, `Adam`
            or `torchrec.optim.RowWiseAdagrad`; on CPU not Adam).
        embedding_optimizer_kwargs: its arguments (`lr`, ...).
        data_parallel: wrap the rest of the model in DMP's DDP over `pg`; False leaves its
            gradients alone (pipeline stages average theirs themselves, `recsys_pipe.pp.stage`).

    Returns:
        The `DistributedModelParallel` model."""
    modules = embedding_modules(model)
    if not modules:
        raise ConfigError(
            ConfigProblem(
                "model.builder",
                f"model '{cfg.label}' has a ShardedModelConfig but no torchrec EmbeddingCollection or "
                "EmbeddingBagCollection: give its builder a ModelConfig (plain torch tables, DDP) instead",
            )
        )
    if cfg.compute_kernel == "fused":
        optimize_tables_in_backward(model, embedding_optimizer, embedding_optimizer_kwargs)
    plan = sharding_plan(model, cfg, pg.size(), device.type, batch_size=batch_size)
    sharded = DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(pg),
        device=device,
        plan=plan,
        sharders=[EmbeddingCollectionSharder(), EmbeddingBagCollectionSharder()],
        init_data_parallel=data_parallel,
    )
    if cfg.compute_kernel == "dense" and device.type == "cpu":
        from recsys_pipe.models.cpu_dense_lookup import use_unpooled_cpu_lookups

        use_unpooled_cpu_lookups(sharded)
    return sharded


def make_optimizer(
    model: DistributedModelParallel,
    dense_optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer] = lambda params: torch.optim.Adam(
        params, lr=1e-3
    ),
) -> CombinedOptimizer:
    """Dense optimizer over every parameter not updated in backward (the dense network, and the
    tables on the dense kernel) combined with DMP's fused embedding optimizer, so
    `zero_grad`/`step` cover the whole model (the fused part's `step` is a no-op: its update
    already happened in backward)."""
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())), dense_optimizer)
    return CombinedOptimizer([model.fused_optimizer, dense])
