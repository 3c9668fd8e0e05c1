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

To offer a type on the CPU for another table module (e.g. managed-collision tables), add one
entry: `SHARDERS[MyTables] = offered_on_cpu(MyTablesSharder, ("row_wise",))`. What each entry
offers is checked by `tests/unit/test_sharders.py`; whether it trains like one rank, by
`tests/integration/test_multi_host.py` and `scripts/multi_host.sh` (8 ranks as 2 hosts x 4).

`grid_shard` is not offered on the CPU: nothing here trains it yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ModuleSharder
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

__all__ = [
    "CPU_BAG_TYPES",
    "SHARDERS",
    "CpuEmbeddingBagCollectionSharder",
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

#: table module class -> the class of the sharder the project shards it with
SHARDERS: dict[type[nn.Module], Callable[[], ModuleSharder]] = {
    EmbeddingBagCollection: CpuEmbeddingBagCollectionSharder,
    EmbeddingCollection: EmbeddingCollectionSharder,
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
