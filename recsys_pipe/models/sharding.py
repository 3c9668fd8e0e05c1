"""Shard a model's torchrec tables with DistributedModelParallel, and build its optimizer.

The sharding plan (`model.sharding`) covers every `EmbeddingCollection` and
`EmbeddingBagCollection` of the model. Hand-built plans (`construct_module_sharding_plan`), the
same rule for every table, tables taken in model order (table `i`):

* `table_wise`: table `i` whole on rank `i % world_size`;
* `row_wise`: every table split by rows over all ranks;
* `column_wise`: table `i` split by columns into `k` shards on `k` consecutive ranks (starting at
  rank `i * k`, wrapping around), `k` the most shards, up to the world size, whose widths divide
  the embedding dimension into multiples of 4 (torchrec's smallest column block);
* `table_column_wise`: the same within one host: table `i` on host `i % hosts`, `k` up to the
  ranks per host;
* `table_row_wise`: table `i` split by rows over the ranks of host `i % hosts` (needs 2+ hosts:
  on one host it would be `row_wise` with extra process groups, and is refused);
* `planner`: torchrec's `EmbeddingShardingPlanner` for the real topology -- world size, the
  ranks per host (`LOCAL_WORLD_SIZE`, as torchrun sets it) and the compute device -- with the
  per-table `model.sharding_constraints`.

Every type must be offered by the table's sharder on the device (`recsys_pipe.models.sharders`:
torchrec's, with `row_wise` and `table_row_wise` of bag tables also offered on the CPU); a type
that is not is refused as a config error naming the table, before any process group starts.

Every rank plans itself, then takes rank 0's plan. torchrec's `collective_plan` plans on rank 0
only and broadcasts, so a planner failure there leaves the other ranks waiting in the broadcast;
planning everywhere makes a failure happen on every rank alike (before the broadcast), and each
exits with the planner's message as a config error. The broadcast is still needed: torchrec's
planner breaks ties between equally good plans in the order it iterates sets of strings, which
differs between processes (Python randomises string hashing per process). Seen with two torchrun
agents: the ranks of one host planned a table `column_wise` that the other host's ranks planned
`table_wise`, and their first all-to-all failed. (Ranks forked from one process share the hash
seed and agree; hand-built plans agree anyway.)

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

import dataclasses
import hashlib
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory
from torchrec.distributed.planner.types import TrainerConfig as PlannerTrainerConfig
from torchrec.distributed.sharding_plan import (
    ParameterShardingGenerator,
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.data.batch import register_with_torchrec
from recsys_pipe.models.base import ShardedModelConfig
from recsys_pipe.models.managed import MANAGED_TABLE_TYPES, plan_buckets
from recsys_pipe.models.sharders import project_sharders, sharder_for

__all__ = [
    "MULTI_HOST_TYPES",
    "column_shards",
    "embedding_modules",
    "has_torchrec_tables",
    "init_table_slice",
    "local_world_size",
    "make_optimizer",
    "make_sharded_model",
    "optimize_tables_in_backward",
    "sharding_plan",
    "table_features",
    "table_shapes",
]

register_with_torchrec()  # our batches are torchrec Pipelineables wherever torchrec shards a model

#: fraction of each device's memory the planner leaves for everything but the tables
STORAGE_RESERVATION = 0.15
#: sharding types that place each table within one host and need several hosts
MULTI_HOST_TYPES = ("table_row_wise",)
#: torchrec's column shards are a multiple of this many columns wide (`_find_base_dim`)
COLUMN_BLOCK = 4
#: rows of a table drawn from one seed by the per-shard initialisation (`init_table_slice`)
INIT_BLOCK_ROWS = 4096
#: the modules whose tables DMP shards (a managed-collision collection holds its table module)
_TABLE_MODULES = (EmbeddingCollection, EmbeddingBagCollection, *MANAGED_TABLE_TYPES)


def embedding_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The torchrec tables' modules of `model` by qualified name: its `EmbeddingCollection`s,
    `EmbeddingBagCollection`s and managed-collision collections (`recsys_pipe.models.managed`),
    which torchrec shards as one module with the collection inside them."""
    found = {fqn: m for fqn, m in model.named_modules() if isinstance(m, _TABLE_MODULES)}
    inside = {f"{fqn}._embedding_module" for fqn, m in found.items() if isinstance(m, MANAGED_TABLE_TYPES)}
    return {fqn: m for fqn, m in found.items() if fqn not in inside}


def has_torchrec_tables(model: nn.Module) -> bool:
    return bool(embedding_modules(model))


def _table_configs(module: nn.Module) -> list[Any]:
    if isinstance(module, MANAGED_TABLE_TYPES):
        module = module._embedding_module
    return module.embedding_configs() if isinstance(module, EmbeddingCollection) else module.embedding_bag_configs()


def _tables(module: nn.Module) -> list[str]:
    return [cfg.name for cfg in _table_configs(module)]


def table_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Every torchrec table of `model` by name: (rows, embedding dimension)."""
    return {
        cfg.name: (cfg.num_embeddings, cfg.embedding_dim)
        for module in embedding_modules(model).values()
        for cfg in _table_configs(module)
    }


def table_features(module: nn.Module) -> dict[str, list[str]]:
    """Each table of an `EmbeddingCollection`/`EmbeddingBagCollection` by name: the KJT features
    it looks up."""
    return {cfg.name: list(cfg.feature_names) for cfg in _table_configs(module)}


def local_world_size(world_size: int) -> int:
    """Ranks on this host: `LOCAL_WORLD_SIZE` as torchrun sets it; `world_size` (one host) when
    the process was not started by torchrun."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def column_shards(dim: int, ranks: int) -> int:
    """Column shards of a table `dim` wide over `ranks` ranks: the most, up to `ranks`, whose
    equal widths are multiples of `COLUMN_BLOCK` (1 when none is)."""
    fits = [k for k in range(1, ranks + 1) if dim % k == 0 and (dim // k) % COLUMN_BLOCK == 0]
    return max(fits, default=1)


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
        local_size: ranks per host (default: `local_world_size(world_size)`); divides `world_size`.
        batch_size: the per-rank batch size, for the planner's estimates.

    Returns:
        torchrec's `ShardingPlan`. Raises ConfigError (at `model.sharding` /
        `model.sharding_constraints.<table>`) when the choice cannot work: a sharding type the
        table's sharder does not offer on this device, `table_row_wise` on one host, a constraint
        naming no table, or a planner failure (with the planner's message)."""
    local_size = local_world_size(world_size) if local_size is None else local_size
    if local_size < 1 or world_size % local_size:
        raise ValueError(f"{local_size} ranks per host do not divide {world_size} ranks")
    modules = embedding_modules(model)
    if cfg.sharding == "planner":
        return _planner_plan(model, modules, cfg, world_size, local_size, device_type, batch_size)
    if cfg.sharding in MULTI_HOST_TYPES and world_size == local_size:
        raise ConfigError(ConfigProblem("model.sharding", _one_host(cfg.sharding, world_size)))
    plan: dict[str, Any] = {}
    index = 0
    for fqn, module in modules.items():
        sharder = sharder_for(module)
        offered = sharder.sharding_types(device_type)
        if cfg.sharding not in offered:
            first = _tables(module)[0]
            raise ConfigError(
                ConfigProblem(
                    "model.sharding",
                    f"{cfg.sharding} is not offered for table '{first}' (module '{fqn}', {type(module).__name__}) "
                    f"by {type(sharder).__name__} on {device_type}; it offers {', '.join(offered)}: use one of those, "
                    "or model.sharding=planner with model.sharding_constraints to choose per table",
                )
            )
        per_table = {}
        for table in _table_configs(module):
            per_table[table.name] = _placement(
                cfg.sharding, index, table.embedding_dim, world_size, local_size, cfg.compute_kernel
            )
            index += 1
        plan[fqn] = construct_module_sharding_plan(
            module, per_table, sharder=sharder, local_size=local_size, world_size=world_size, device_type=device_type
        )
    return ShardingPlan(plan)


def _one_host(sharding: str, world_size: int) -> str:
    return (
        f"{sharding} splits each table over the ranks of one host and needs 2 or more hosts; these {world_size} "
        "rank(s) are one host (local_world_size = world_size): use row_wise, or start more hosts"
    )


def _placement(
    sharding: str, index: int, dim: int, world_size: int, local_size: int, kernel: str
) -> ParameterShardingGenerator:
    """torchrec's generator of table `index`'s shards for a hand-built `sharding` (module docstring)."""
    hosts = world_size // local_size
    if sharding == "table_wise":
        return table_wise(rank=index % world_size, compute_kernel=kernel)
    if sharding == "row_wise":
        return row_wise(compute_kernel=kernel)
    if sharding == "table_row_wise":
        return _with(table_row_wise(host_index=index % hosts), compute_kernel=kernel)
    within_host = sharding == "table_column_wise"
    group = local_size if within_host else world_size
    first = (index % hosts) * local_size if within_host else 0
    k = column_shards(dim, group)
    start = (index // hosts if within_host else index) * k
    generator = column_wise(ranks=[first + (start + j) % group for j in range(k)], compute_kernel=kernel)
    return _with(generator, sharding_type="table_column_wise") if within_host else generator


def _with(generator: ParameterShardingGenerator, **fields: str) -> ParameterShardingGenerator:
    """`generator` with `fields` of its `ParameterSharding` replaced (torchrec's `table_row_wise`
    takes no kernel; there is no `table_column_wise` generator: it is column-wise shards placed
    within one host)."""

    def generate(*args: Any) -> Any:
        return dataclasses.replace(generator(*args), **fields)

    return generate


def _planner_plan(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    cfg: ShardedModelConfig,
    world_size: int,
    local_size: int,
    device_type: str,
    batch_size: int,
) -> ShardingPlan:
    constraints = _planner_constraints(modules, cfg, world_size, local_size, device_type)
    plan_buckets(model, world_size)
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
    try:
        return planner.plan(model, project_sharders(list(modules.values())))
    except Exception as exc:  # any planner failure: every rank reports it the same way and exits
        raise ConfigError(ConfigProblem("model.sharding", f"torchrec's planner found no plan: {exc}")) from None


def _planner_constraints(
    modules: Mapping[str, nn.Module], cfg: ShardedModelConfig, world_size: int, local_size: int, device_type: str
) -> dict[str, ParameterConstraints]:
    """`model.sharding_constraints` as torchrec's, each type checked against what the table's
    sharder offers on `device_type`; ConfigError naming every table whose constraint cannot work."""
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
        key = f"model.sharding_constraints.{name}"
        if isinstance(module, EmbeddingCollection) and device_type == "cpu":
            if "data_parallel" in allowed:
                problems.append(
                    ConfigProblem(
                        key,
                        "data_parallel does not work for EmbeddingCollection tables on CPU (torchrec's data-parallel "
                        "EmbeddingCollection fails there); allow row_wise, column_wise or table_wise",
                    )
                )
                continue
            if not allowed:  # keep the planner from choosing it on its own
                allowed = [t for t in sharder_for(module).sharding_types("cpu") if t != "data_parallel"]
        offered = sharder_for(module).sharding_types(device_type)
        refused = [t for t in allowed if t not in offered]
        if refused:
            problems.append(
                ConfigProblem(
                    key,
                    f"{', '.join(refused)} not offered for table '{name}' ({type(module).__name__}) by "
                    f"{type(sharder_for(module)).__name__} on {device_type}; it offers {', '.join(offered)}",
                )
            )
        elif world_size == local_size and any(t in MULTI_HOST_TYPES for t in allowed):
            problems.append(ConfigProblem(key, _one_host("table_row_wise", world_size)))
        elif allowed:
            constraints[name] = ParameterConstraints(sharding_types=allowed)
    if problems:
        raise ConfigError(problems)
    return constraints


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
    plan: ShardingPlan | None = None,
    init_seed: int | None = None,
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
        plan: the sharding plan to use (default: `sharding_plan` for `pg`'s ranks and `device`).
        init_seed: `model.table_init=per_shard`: the model's tables are on the meta device and
            each rank draws its own shards' values from this seed (`init_table_slice`); None:
            the shards are copied from the built tables (or, built on meta, left as torchrec
            initialised them).

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
    ranks = pg.size()
    if plan is None:
        # the ranks of `pg` per host; a group of some ranks of each host (a pipeline stage's
        # replicas) may not hold whole hosts: the largest count dividing both stands in
        local = math.gcd(local_world_size(ranks), ranks)
        plan = sharding_plan(model, cfg, ranks, device.type, local, batch_size=batch_size)
        if cfg.sharding == "planner" and ranks > 1:  # the same tie-breaks on every rank: rank 0's
            chosen = [plan]
            dist.broadcast_object_list(chosen, src=dist.get_global_rank(pg, 0), group=pg)
            plan = chosen[0]
    weights = _table_weights(model)
    configs = _table_configs_by_key(model)
    _mark_meta_collections(modules)
    sharded = DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(pg),
        device=device,
        plan=plan,
        sharders=project_sharders(),
        init_data_parallel=data_parallel,
    )
    if init_seed is None:
        _load_shards(sharded, weights)
    else:
        _init_shards(sharded, configs, init_seed)
    if cfg.compute_kernel == "dense" and device.type == "cpu":
        from recsys_pipe.models.cpu_dense_lookup import use_unpooled_cpu_lookups

        use_unpooled_cpu_lookups(sharded)
    return sharded


def _table_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model's table weights by state-dict key (references, not copies)."""
    prefixes = tuple(f"{fqn}." for fqn in embedding_modules(model))
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if k.startswith(prefixes) and v.dim() == 2}


def _load_shards(sharded: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy each table's rows and columns of this rank's shards from the unsharded `weights`,
    then free the unsharded tables' memory.

    torchrec's sharded modules initialise their shards afresh (each rank draws its own shards'
    values), so without the copy a table's initial values would depend on the sharding type and
    the world size. With it, every layout starts from the weights the seeded model was built
    with, and N ranks train what one rank trains (`tests/integration/test_multi_host.py`).

    torchrec keeps the unsharded parameters referenced after sharding (its sharding infos, and
    the in-backward optimizer hooks), so every rank would hold the whole unsharded tables for
    the rest of the run; their storage is released here instead (shape kept, as FSDP frees a
    parameter's storage). Skipped for a model built on the meta device (nothing to copy)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    in_use = set()
    for key, value in sharded.state_dict().items():
        full = weights.get(key)
        if full is None or full.is_meta or not isinstance(value, ShardedTensor):
            continue
        with torch.no_grad():
            for shard in value.local_shards():
                (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(full[row : row + rows, col : col + cols])
                in_use.add(shard.tensor.untyped_storage().data_ptr())
    for full in weights.values():
        storage = full.untyped_storage()
        if not full.is_meta and storage.data_ptr() not in in_use:
            storage.resize_(0)


def _mark_meta_collections(modules: Mapping[str, nn.Module]) -> None:
    """Tell each `EmbeddingCollection` whose tables were built on the meta device that it is
    there. It records the `device` it was given (the CPU when none, as under `torch.device("meta")`)
    rather than where its tables are, and torchrec's `ShardedEmbeddingCollection` copies the
    module's state into its shards unless that device is meta: from meta tables that copy fails
    ("Cannot copy out of meta tensor"). `EmbeddingBagCollection` reads its tables' device."""
    for module in modules.values():
        if isinstance(module, EmbeddingCollection) and all(p.is_meta for p in module.parameters()):
            module._device = torch.device("meta")


def _table_configs_by_key(model: nn.Module) -> dict[str, Any]:
    """Each table's torchrec config (`EmbeddingConfig` / `EmbeddingBagConfig`) by the state-dict
    key of its weight."""
    keys = _table_weights(model)
    configs = {}
    for fqn, module in embedding_modules(model).items():
        by_name = {cfg.name: cfg for cfg in _table_configs(module)}
        for key in keys:
            name = key.rsplit(".", 2)[-2]
            if key.startswith(f"{fqn}.") and name in by_name:
                configs[key] = by_name[name]
    return configs


def init_table_slice(config: Any, seed: int, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """Rows `rows[0]` to `rows[1]` (excluded) and columns `cols[0]` to `cols[1]` of the table of
    `config` (a torchrec table config) as `model.table_init=per_shard` initialises it, on the CPU
    in float32.

    The table is cut into blocks of `INIT_BLOCK_ROWS` rows, each drawn whole by the table's own
    `init_fn` (the unsharded build's: torchrec's uniform by default, a model's own where it sets
    one) from a generator seeded from (`seed`, table name, block index) alone: a shard computes
    its slice from the blocks it overlaps, without the rest of the table (a column shard draws
    its blocks' full width and keeps its columns), and a row gets the same values whatever the
    sharding type and world size. torchrec's sharded kernels would initialise the shards
    themselves, but with a uniform between the table's `weight_init_min/max`, not its `init_fn`
    (`BaseBatchedEmbeddingBag.init_parameters`), and from each rank's global generator."""
    out = torch.empty(rows[1] - rows[0], cols[1] - cols[0])
    _fill_table_slice(out, config, seed, rows, cols)
    return out


def _fill_table_slice(
    target: torch.Tensor, config: Any, seed: int, rows: tuple[int, int], cols: tuple[int, int]
) -> None:
    """Write `init_table_slice(config, seed, rows, cols)` into `target` (a shard, on any device)
    one block at a time: no second copy of the shard is ever held."""
    (first, stop), (col, col_stop) = rows, cols
    for block in range(first // INIT_BLOCK_ROWS, (stop - 1) // INIT_BLOCK_ROWS + 1 if stop > first else 0):
        start = block * INIT_BLOCK_ROWS
        values = torch.empty(min(INIT_BLOCK_ROWS, config.num_embeddings - start), config.embedding_dim)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_block_seed(seed, config.name, block))
            drawn = config.init_fn(values)
        values = values if drawn is None else drawn
        lo, hi = max(first, start), min(stop, start + values.shape[0])
        target[lo - first : hi - first].copy_(values[lo - start : hi - start, col:col_stop])


def _block_seed(seed: int, table: str, block: int) -> int:
    """A 63-bit seed for one block of one table (a hash: neighbouring blocks' seeds share nothing)."""
    digest = hashlib.sha256(f"{seed}/{table}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _init_shards(sharded: nn.Module, configs: Mapping[str, Any], seed: int) -> None:
    """`model.table_init=per_shard`: fill this rank's shards of every table (`configs`, by
    state-dict key) with their slices of `init_table_slice`; a table held whole on every rank
    (data_parallel) gets the whole table, the same on every rank."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    with torch.no_grad():
        for key, value in sharded.state_dict().items():
            config = configs.get(key)
            if config is None:
                continue
            if not isinstance(value, ShardedTensor):
                _fill_table_slice(value, config, seed, (0, value.shape[0]), (0, value.shape[1]))
                continue
            for shard in value.local_shards():
                (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                _fill_table_slice(shard.tensor, config, seed, (row, row + rows), (col, col + cols))


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
