"""The torchrec sharders the project shards tables with, and which sharding types each offers.

A torchrec sharder says which sharding types it offers on a device (`sharding_types(device)`):
the hand-built plans (`model.sharding=row_wise`, ...) and torchrec's planner only use those.
torchrec 1.8's bag-table sharder (`EmbeddingBagCollectionSharder`) offers `row_wise`,
`table_row_wise` and `grid_shard` on CUDA only, although their implementation (the row-wise
input split, the reduce-scatter of pooled embeddings, the intra-host and cross-host groups of
table-row-wise, fbgemm's fused CPU kernels) runs on the CPU under gloo. So the CPU could not
test the layouts a GPU cluster trains with.

`offered_on_cpu(sharder_class, types)` is the one mechanism that changes this: a subclass of a
torchrec sharder that also offers `types` on the CPU and is otherwise torchrec's class (same
module type, same sharded module, same kernels). `SHARDERS` maps each table module class to the
sharder the project uses for it; the hand-built plans, torchrec's planner and
`DistributedModelParallel` all get their sharders from `sharder_for` / `project_sharders`, so a
type offered here is offered everywhere, and a type offered nowhere is refused before any
process starts (`recsys_pipe.models.sharding`).

To offer a type on the CPU for another table module, add one entry:
`SHARDERS[MyTables] = offered_on_cpu(MyTablesSharder, ("row_wise",))`. What each entry offers is
checked by `tests/unit/test_sharders.py`; whether it trains like one rank, by
`tests/integration/test_multi_host.py` and `scripts/multi_host.sh` (8 ranks as 2 hosts x 4).

Managed-collision tables (`ids: managed`, `recsys_pipe.models.managed`): torchrec's sharders of
`ManagedCollisionEmbeddingBagCollection` / `...EmbeddingCollection` offer the types both the
table sharder and the managed-collision sharder offer: `row_wise`, for bag tables on CUDA only
(the bag-table sharder's row-wise). The project's bag version is torchrec's over the project's
bag-table sharder, so it offers `row_wise` on the CPU too; both offer only the fused kernel on
the CPU, where torchrec's planner has no estimate for its UVM kernels (which have no CPU form).
The row-wise managed modules run on the CPU under gloo as torchrec wrote them (remap, eviction,
the re-initialisation of evicted rows; `tests/integration/test_raw_ids.py`) but for one step:
an evicted row's row-wise Adagrad state is reset by fbgemm's `reset_weight_momentum`, which has
no CPU kernel (`NotImplementedError: Could not run 'fbgemm::reset_weight_momentum' with arguments
from the 'CPU' backend`, from torchrec's `BaseShardedManagedCollisionEmbeddingCollection._evict`
through fbgemm's `reset_embedding_weight_momentum`). The project's sharded modules
(`_CpuEviction`) reset that state on the CPU themselves, as the kernel does on CUDA (row-wise
Adagrad only; torchrec resets no other optimizer's state).

`grid_shard` is not offered on the CPU: nothing here trains it yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.mc_embedding import (
    ManagedCollisionEmbeddingCollectionSharder,
    ShardedManagedCollisionEmbeddingCollection,
)
from torchrec.distributed.mc_embeddingbag import (
    ManagedCollisionEmbeddingBagCollectionSharder,
    ShardedManagedCollisionEmbeddingBagCollection,
)
from torchrec.distributed.types import ModuleSharder
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)

__all__ = [
    "CPU_BAG_TYPES",
    "SHARDERS",
    "CpuEmbeddingBagCollectionSharder",
    "ManagedBagSharder",
    "ManagedSequenceSharder",
    "offered_on_cpu",
    "project_sharders",
    "sharder_for",
]

#: the bag-table types torchrec offers on CUDA only whose implementation runs on the CPU (gloo)
CPU_BAG_TYPES = ("row_wise", "table_row_wise")


def offered_on_cpu(base: type[ModuleSharder], types: Sequence[str]) -> type[ModuleSharder]:
    """A subclass of the torchrec sharder `base` that also offers `types` on the CPU (after the
    types `base` offers there); on every other device it is `base`."""
    extra = tuple(types)

    def sharding_types(self: Any, compute_device_type: str) -> list[str]:
        offered = list(base.sharding_types(self, compute_device_type))
        if compute_device_type == "cpu":
            offered += [t for t in extra if t not in offered]
        return offered

    doc = f"torchrec's `{base.__name__}`, which also offers {', '.join(extra)} on the CPU (`offered_on_cpu`)."
    return type(f"Cpu{base.__name__}", (base,), {"sharding_types": sharding_types, "__doc__": doc, "cpu_types": extra})


CpuEmbeddingBagCollectionSharder = offered_on_cpu(EmbeddingBagCollectionSharder, CPU_BAG_TYPES)


def _fused_on_cpu(kernels: list[str], compute_device_type: str) -> list[str]:
    """A managed-collision sharder's kernels: on the CPU only the fused one (module docstring)."""
    fused = EmbeddingComputeKernel.FUSED.value
    return [fused] if compute_device_type == "cpu" else kernels


class _CpuEviction:
    """torchrec's sharded managed-collision module with its eviction made to run on the CPU
    (module docstring): there the evicted rows' row-wise Adagrad state is zeroed here, through
    fbgemm's views of it (`split_optimizer_states`), and the rows are re-initialised with their
    table's `init_fn` as torchrec's `_evict` does; on CUDA it is torchrec's `_evict`."""

    def _evict(self, evictions_per_table: dict[str, torch.Tensor | None]) -> None:
        if self._device.type != "cpu":
            return super()._evict(evictions_per_table)  # type: ignore[misc]
        for table, rows in evictions_per_table.items():
            if rows is None or not rows.numel():
                continue
            rows = rows.long()
            tbe, index = self._table_to_tbe_and_index[table]
            with torch.no_grad():
                if tbe.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
                    for state in tbe.split_optimizer_states()[int(index)]:
                        state[rows] = 0
                tables = self._embedding_module.embedding_bags if self.bagged else self._embedding_module.embeddings
                weight = tables.get_parameter(f"{table}.weight")
                init_fn = self._embedding_module._table_name_to_config[table].init_fn
                target = weight.data if self._allow_in_place_embed_weight_update else weight
                target[rows] = init_fn(weight[rows])
        return None


class _ShardedManagedBags(_CpuEviction, ShardedManagedCollisionEmbeddingBagCollection):
    """torchrec's sharded managed-collision bag tables, evicting on the CPU too (`_CpuEviction`)."""


class _ShardedManagedSequences(_CpuEviction, ShardedManagedCollisionEmbeddingCollection):
    """torchrec's sharded managed-collision sequence tables, evicting on the CPU too (`_CpuEviction`)."""


class ManagedBagSharder(ManagedCollisionEmbeddingBagCollectionSharder):
    """torchrec's sharder of managed-collision bag tables over `CpuEmbeddingBagCollectionSharder`:
    `row_wise` on the CPU as on CUDA, the fused kernel only on the CPU, evictions that run on
    the CPU (module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(ebc_sharder=CpuEmbeddingBagCollectionSharder(), **kwargs)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return _fused_on_cpu(super().compute_kernels(sharding_type, compute_device_type), compute_device_type)

    def shard(self, module: Any, params: Any, env: Any, device: Any = None, module_fqn: Any = None) -> Any:
        return _ShardedManagedBags(
            module, params, ebc_sharder=self._e_sharder, mc_sharder=self._mc_sharder, env=env, device=device
        )


class ManagedSequenceSharder(ManagedCollisionEmbeddingCollectionSharder):
    """torchrec's sharder of managed-collision sequence tables (`row_wise` on both devices), with
    the fused kernel only on the CPU and evictions that run on the CPU (module docstring)."""

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return _fused_on_cpu(super().compute_kernels(sharding_type, compute_device_type), compute_device_type)

    def shard(self, module: Any, params: Any, env: Any, device: Any = None, module_fqn: Any = None) -> Any:
        return _ShardedManagedSequences(
            module, params, ec_sharder=self._e_sharder, mc_sharder=self._mc_sharder, env=env, device=device
        )


#: table module class -> the class of the sharder the project shards it with
SHARDERS: dict[type[nn.Module], Callable[[], ModuleSharder]] = {
    EmbeddingBagCollection: CpuEmbeddingBagCollectionSharder,
    EmbeddingCollection: EmbeddingCollectionSharder,
    ManagedCollisionEmbeddingBagCollection: ManagedBagSharder,
    ManagedCollisionEmbeddingCollection: ManagedSequenceSharder,
}


def sharder_for(module: nn.Module) -> ModuleSharder:
    """The sharder of `module` (the most specific class of it in `SHARDERS`)."""
    for cls in type(module).__mro__:
        if cls in SHARDERS:
            return SHARDERS[cls]()
    raise TypeError(f"no sharder for {type(module).__name__} (recsys_pipe.models.sharders.SHARDERS)")


def project_sharders(modules: Sequence[nn.Module] | None = None) -> list[ModuleSharder]:
    """One sharder per table module class of `modules` (default: every class in `SHARDERS`),
    for `DistributedModelParallel` and torchrec's planner."""
    if modules is None:
        return [make() for make in SHARDERS.values()]
    chosen = {type(s): s for s in (sharder_for(m) for m in modules)}
    return list(chosen.values())
