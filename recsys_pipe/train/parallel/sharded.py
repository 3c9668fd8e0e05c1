"""`ShardedTables`: a model with torchrec tables, sharded over the ranks by
`DistributedModelParallel` (`model.sharding`), with the embedding optimizer fused into their
backward (or on torchrec's dense kernel, `model.compute_kernel=dense`); the dense part is
replicated under DDP. torchrec is imported only here and by the tasks that need it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from recsys_pipe.config import ConfigError, ConfigProblem, UserCodeError
from recsys_pipe.models.base import ShardedModelConfig
from recsys_pipe.train.dense_ddp import check_dense_ddp
from recsys_pipe.train.managed import check_model, refuse_managed
from recsys_pipe.train.optim import check_sparse_device, dense_optimizer_factory, sparse_optimizer
from recsys_pipe.train.parallel.base import Parallelism
from recsys_pipe.train.parallel.replicated import seeded_model

if TYPE_CHECKING:
    from recsys_pipe.config import CompiledPlan
    from recsys_pipe.data.batch import DataSpec
    from recsys_pipe.engine import StreamPool
    from recsys_pipe.runtime.distributed import DistInfo
    from recsys_pipe.train.parallel.topology import Topology
    from recsys_pipe.train.rng import RngState

__all__ = ["ShardedTables", "describe_sharding", "meta_model", "model_with_meta_tables", "planned_sharding"]


class ShardedTables(Parallelism):
    """torchrec shards the tables over every rank; DDP averages the dense part's gradients."""

    def check(self, topology: Topology) -> None:
        """Besides the devices' support of the optimizers: the sharding plan for these ranks, made
        on the meta device (a type a table's sharder does not offer on the device,
        `table_row_wise` on one host, a planner that finds no plan: ConfigError naming the key),
        and what managed ids need of the model and the plan (`recsys_pipe.train.managed`); with
        `model.table_init=per_shard`, that the model can be built so (`model_with_meta_tables`)."""
        topology.check()
        check_dense_ddp(self.run, topology.device_type)
        if self.run.model.table_init == "per_shard":
            refuse_managed(
                self.run.data.spec(),
                "model.table_init=per_shard cannot initialise managed-collision tables shard by shard; use "
                "model.table_init=unsharded",
            )
        if self.run.model.compute_kernel == "fused":
            check_sparse_device(self.run.optimizer.sparse, topology.device_type)
        try:
            module, plan = planned_sharding(self.run, self.run.model, *_sizes(topology))
            if self.run.model.table_init == "per_shard":
                with torch.device("meta"):
                    _refuse_vocab_dependent(self.run, module, self.run.model.build(_cut(self.run.data.spec())))
        except UserCodeError:  # the user's builder fails on the meta device: their build after start reports it
            return
        check_model(self.run.data.spec(), module, self.run.model.compute_kernel, plan)

    def planned_model(self, topology: Topology) -> tuple[nn.Module, Any]:
        return planned_sharding(self.run, self.run.model, *_sizes(topology))

    def table_shapes(self) -> dict[str, tuple[int, int]]:
        from recsys_pipe.models.sharding import table_shapes

        return table_shapes(meta_model(self.run))

    def build_model(self, spec: DataSpec, info: DistInfo, rng: RngState) -> tuple[nn.Module, Any]:
        from recsys_pipe.models.sharding import make_optimizer, make_sharded_model

        run = self.run
        check_dense_ddp(run, info.device.type)  # again, for programmatic use
        per_shard = run.model.table_init == "per_shard"
        module = model_with_meta_tables(run, spec, rng) if per_shard else seeded_model(run, spec, rng)
        embedding_opt, embedding_kwargs = sparse_optimizer(run.optimizer.sparse)
        model = make_sharded_model(
            module,
            run.model,
            dist.group.WORLD,
            info.device,
            batch_size=run.data.batch_size,
            embedding_optimizer=embedding_opt,
            embedding_optimizer_kwargs=embedding_kwargs,
            init_seed=run.seed if per_shard else None,
        )
        return model, make_optimizer(model, dense_optimizer_factory(run.optimizer))

    def input_dist(self, model: nn.Module, info: DistInfo, streams: StreamPool, plan: CompiledPlan) -> Any:
        from recsys_pipe.train.sparse_dist import TorchrecSparseDist

        return TorchrecSparseDist(model, info.device, streams, context=plan.config.torchrec_context)

    def describe_model(self, plan: CompiledPlan, world_size: int, local_size: int, device_type: str) -> str:
        return describe_sharding(self.run, self.run.model, world_size, local_size, device_type)


def _sizes(topology: Topology) -> tuple[int, int, str]:
    return topology.world_size, topology.local_world_size, topology.device_type


def meta_model(run: Any, cfg: ShardedModelConfig | None = None) -> nn.Module:
    """The run's model built on the meta device (shapes, no memory), its tables' optimizer
    fused into backward as in training when `cfg` (default: `run.model`) has them on the fused
    kernel: what planning needs."""
    from recsys_pipe.models.sharding import optimize_tables_in_backward

    with torch.device("meta"):
        module = run.model.build(run.data.spec())
    if (cfg or run.model).compute_kernel == "fused":
        optimize_tables_in_backward(module, *sparse_optimizer(run.optimizer.sparse))
    return module


#: `model_with_meta_tables` builds the dense part with every vocabulary cut to this many rows
CUT_ROWS = 1


def model_with_meta_tables(run: Any, spec: DataSpec, rng: RngState) -> nn.Module:
    """`model.table_init=per_shard`: the run's model with its torchrec tables on the meta device
    (no table memory; each rank then draws its own shards, `make_sharded_model(init_seed=...)`)
    and the rest built on the CPU from the seed, the same on every rank.

    The rest comes from the model built (`seeded_model`) with every vocabulary cut to `CUT_ROWS`
    rows, its table modules then replaced by those of the model built on the meta device with
    the real vocabularies (their configs, init functions included, are the full tables'). A
    builder whose other parameters depend on the vocabulary sizes cannot be built this way:
    ConfigError naming the key (`ShardedTables.check` finds it before the start)."""
    from recsys_pipe.models.sharding import embedding_modules

    with torch.device("meta"):
        whole = run.model.build(spec)
    full = embedding_modules(whole)
    module = seeded_model(run, _cut(spec), rng)
    small = embedding_modules(module)
    replace = {id(small[fqn]): full[fqn] for fqn in small}
    for parent in module.modules():
        for name, child in parent._modules.items():
            if id(child) in replace:
                parent._modules[name] = replace[id(child)]
    _refuse_vocab_dependent(run, whole, module)
    return module


def _cut(spec: DataSpec) -> DataSpec:
    return dataclasses.replace(spec, vocab_sizes={k: min(v, CUT_ROWS) for k, v in spec.vocab_sizes.items()})


def _refuse_vocab_dependent(run: Any, whole: nn.Module, other: nn.Module) -> None:
    """ConfigError naming `model.table_init` if `other` (the model built with cut vocabularies)
    has parameters or buffers outside the torchrec tables of other shapes than `whole`'s."""
    from recsys_pipe.models.sharding import embedding_modules

    tables = tuple(f"{fqn}." for fqn in embedding_modules(whole))
    want, got = _shapes(whole, tables), _shapes(other, tables)
    differ = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
    if differ:
        raise ConfigError(
            ConfigProblem(
                "model.table_init",
                f"per_shard: model '{run.model.label}' has parameters outside its torchrec tables whose shape "
                f"depends on the vocabulary sizes ({', '.join(differ[:3])}); use unsharded",
            )
        )


def _shapes(module: nn.Module, tables: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    named = [*module.named_parameters(), *module.named_buffers()]
    return {name: tuple(t.shape) for name, t in named if not name.startswith(tables)}


def planned_sharding(
    run: Any, cfg: ShardedModelConfig, ranks: int, local_size: int, device_type: str
) -> tuple[nn.Module, Any]:
    """The meta model (`meta_model`) and torchrec's sharding plan `cfg` gives it over `ranks`
    ranks (`local_size` per host) on `device_type`; ConfigError where the choice cannot work."""
    from recsys_pipe.models.sharding import sharding_plan

    module = meta_model(run, cfg)
    return module, sharding_plan(module, cfg, ranks, device_type, local_size, batch_size=run.data.batch_size)


def describe_sharding(
    run: Any, cfg: ShardedModelConfig, ranks: int, local_size: int, device_type: str, where: str = ""
) -> str:
    """The model's tables as `cfg` shards them over `ranks` ranks (`local_size` per host): the
    heading and torchrec's printout of the sharding plan for this topology, built on the meta
    device (no table memory). `where` names the ranks, when not the whole world."""
    _, sharding = planned_sharding(run, cfg, ranks, local_size, device_type)
    heading = (
        f"model: {run.model.label} (torchrec tables, model.sharding={run.model.sharding}; sharding plan for "
        f"{ranks} rank(s){where}, {local_size} per host, on {device_type})"
    )
    return heading + "\n" + str(sharding).strip("\n")
