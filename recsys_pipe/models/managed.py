"""Managed-collision tables for `ids: managed` features: torchrec's `MCHManagedCollisionModule`
in `ManagedCollisionEmbeddingBagCollection` / `ManagedCollisionEmbeddingCollection`, built from
what the data says (`DataSpec.managed`; docs/raw-ids.md).

A managed table of `n` rows holds up to `n - 1` raw ids, each in a row of its own; the last row
is shared by every raw id without one (new, or evicted). In training, every `eviction_interval`
steps the ids seen since the last eviction compete with the ids in the table by the eviction
policy's score (`lfu`, `lru`, `distance_lfu`), and the rows of the losers are re-initialised for
the winners (torchrec's sharded module does this, with the table's `init_fn`). In evaluation
(the model in eval mode) ids are only looked up: nothing is counted or evicted.

Sharded row-wise over `W` ranks (the one sharding type torchrec offers for managed tables), rank
`k` owns the raw ids in the `k`-th of `W` equal slices of `[0, input_hash_size)` and the `k`-th
block of rows, whose last row is its shared row. `ManagedRows` is torchrec's module with two
things added that this layout needs outside training:

* a copy built unsharded (`recsys-export`, one process) that loads a `W`-rank checkpoint keeps
  the `W` shared rows (`shard_miss_rows`), so it looks ids up exactly as the trained model did;
* the ids counted since the last eviction (which torchrec keeps in memory only) can be saved and
  restored (`history_state`), so a resume is bitwise the unbroken run;
* features that are looked up without being counted (a retrieval model's sampled negatives, which
  share the item table: `ManagedFeature.counted`), through torchrec's read-only features.

A model mixes managed and other tables with `SplitBagCollection` / `SplitCollection`: one torchrec
module for each kind, both called on the batch's KJT (each takes its own features from it, so
torchrec's pipeline still input-distributes both ahead of the forward), their outputs joined.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torchrec.distributed.types import Awaitable
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHEvictionPolicy,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

__all__ = [
    "MANAGED_TABLE_TYPES",
    "ManagedRows",
    "RawIdRemap",
    "SplitBagCollection",
    "SplitCollection",
    "counting_paused",
    "eviction_policy",
    "managed_modules",
    "managed_rows",
    "plan_buckets",
    "remap_raw_ids",
    "served_tables",
    "split_bag_collection",
    "split_collection",
]

#: the managed-collision table modules (what the sharders and plans treat as one table module)
MANAGED_TABLE_TYPES = (ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection)

_POLICIES: dict[str, type[MCHEvictionPolicy]] = {
    "lfu": LFU_EvictionPolicy,
    "lru": LRU_EvictionPolicy,
    "distance_lfu": DistanceLFU_EvictionPolicy,
}


def eviction_policy(name: str) -> MCHEvictionPolicy:
    """torchrec's eviction policy `name` (`lfu`, `lru` or `distance_lfu`)."""
    return _POLICIES[name]()


def remap_raw_ids(
    values: torch.Tensor,
    sorted_raw_ids: torch.Tensor,
    rows: torch.Tensor,
    miss_rows: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Rows of raw ids `values`: where `sorted_raw_ids` holds the id, its row (`rows`, in the same
    order); elsewhere the shared row of the id's slice of the raw id space (`miss_rows[id //
    block_size]`). torchrec's `_mch_remap` with one shared row per row-wise shard; plain tensor
    operations, so an exported program runs it too."""
    found = torch.searchsorted(sorted_raw_ids[:-1], values)
    hit = sorted_raw_ids[found] == values
    shard = torch.div(values, block_size, rounding_mode="floor").clamp(0, miss_rows.numel() - 1)
    return torch.where(hit, rows[found], miss_rows[shard])


class ManagedRows(MCHManagedCollisionModule):
    """torchrec's `MCHManagedCollisionModule` (same arguments, same training behaviour) with
    what the row-wise layout needs outside training (module docstring): the shards' shared rows
    of a loaded checkpoint, and the ids counted since the last eviction as a saveable state."""

    def __init__(self, *args: Any, uncounted: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: the row-wise shards' boundaries (row offsets, then the end) a loaded checkpoint was
        #: trained with, when this module holds all of their rows (an unsharded copy)
        self._loaded_shards: list[int] | None = None
        #: features looked up without counting their ids (`profile`), through torchrec's
        #: read-only features: its sharded collection then hands `profile` and `remap` the
        #: features one by one (its per-feature lookups) when a feature ends with the suffix
        self._set_uncounted(uncounted)

    def rebuild_with_output_id_range(self, *args: Any, **kwargs: Any) -> ManagedRows:
        """torchrec's rebuild (a row-wise shard's module), the uncounted features kept."""
        rebuilt = super().rebuild_with_output_id_range(*args, **kwargs)
        assert isinstance(rebuilt, ManagedRows)
        rebuilt._set_uncounted(self._uncounted)
        return rebuilt

    def _set_uncounted(self, uncounted: Sequence[str] | frozenset[str]) -> None:
        self._uncounted = frozenset(uncounted)
        if uncounted:
            self._enable_per_feature_lookups = True
            self._read_only_suffix = min(uncounted)

    def profile(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        """torchrec's `profile` (count the ids, evict every `eviction_interval` steps) of the
        counted features only; every feature is returned, to be remapped."""
        if self._uncounted:
            super().profile({k: v for k, v in features.items() if k not in self._uncounted})
            return features
        return super().profile(features)

    # -- lookups as the trained (sharded) model made them --------------------------------------

    def validate_state(self) -> None:
        segments = [int(s) for s in self._output_segments_tensor.tolist() if s >= 0]
        super().validate_state()
        start, end = self._output_global_offset, self._output_global_offset + self._zch_size
        whole = len(segments) > 2 and segments[0] == start and segments[-1] == end
        self._loaded_shards = segments if whole else None

    def shard_miss_rows(self) -> tuple[torch.Tensor, int]:
        """The shared rows of the row-wise shards this module's rows came from (one per shard, or
        this module's last row) and the size of each shard's slice of the raw id space."""
        shards = self._loaded_shards or [self._output_global_offset, self._output_global_offset + self._zch_size]
        ends = torch.tensor(shards[1:], dtype=torch.int64, device=self._mch_sorted_raw_ids.device)
        return ends - 1, -(-self._input_hash_size // (len(shards) - 1))

    def remap(
        self,
        features: dict[str, JaggedTensor],
        mutate_miss_lengths: bool = True,
        write_weights: torch.Tensor | None = None,
    ) -> dict[str, JaggedTensor]:
        if self._loaded_shards is None:
            return super().remap(features, mutate_miss_lengths, write_weights)
        miss_rows, block = self.shard_miss_rows()
        return {
            name: JaggedTensor(
                values=remap_raw_ids(
                    jt.values(), self._mch_sorted_raw_ids, self._mch_remapped_ids_mapping, miss_rows, block
                ),
                lengths=jt.lengths(),
                offsets=jt.offsets(),
                weights=jt.weights_or_none(),
            )
            for name, jt in features.items()
        }

    # -- the ids counted since the last eviction -----------------------------------------------

    def history_state(self) -> dict[str, Any]:
        """What torchrec keeps of training in memory only: the iteration counters and the ids
        (with the policy's per-id history) seen since the last eviction. With the module's
        buffers (checkpointed with the tables) it is the whole state of the remapping."""
        n = self._current_history_buffer_offset
        state: dict[str, Any] = {
            "current_iter": self._current_iter,
            "last_eviction_iter": self._last_eviction_iter,
            "buffer_size": self._input_history_buffer_size,
        }
        if self._input_history_buffer_size > 0:
            state["ids"] = self._history_accumulator[:n].clone()
            state.update({f"history.{k}": v[:n].clone() for k, v in self._history_metadata.items()})
        return state

    def load_history_state(self, state: Mapping[str, Any]) -> None:
        """Restore `history_state()`: the next training step counts and evicts as the saved
        run's next step did."""
        self._current_iter = int(state["current_iter"])
        self._last_eviction_iter = int(state["last_eviction_iter"])
        size = int(state["buffer_size"])
        self._current_history_buffer_offset = 0
        if size <= 0:
            return
        self._allocate_history(size)
        ids = state["ids"]
        n = ids.numel()
        self._history_accumulator[:n] = ids
        for name, buffer in self._history_metadata.items():
            buffer[:n] = state[f"history.{name}"]
        self._current_history_buffer_offset = n

    def _allocate_history(self, size: int) -> None:
        """torchrec's `_init_history_buffers` for a given size (it sizes them by the first batch:
        a resumed run must keep the unbroken run's size, whose overflow it drops alike)."""
        self._input_history_buffer_size = size
        device = self._mch_sorted_raw_ids.device
        self._history_accumulator = torch.empty(size, dtype=torch.int64, device=device)
        for name, _, is_history in self._eviction_policy.metadata_info:
            if is_history:
                self.register_buffer(
                    f"_history_{name}", torch.zeros(size, dtype=torch.int64, device=device), persistent=False
                )
                self._history_metadata[name] = getattr(self, f"_history_{name}")


class RawIdRemap(nn.Module):
    """A managed table's remapping as plain tensors, for an exported program: `forward(raw ids)
    -> rows`, as the trained model looked them up (`remap_raw_ids` over the module's raw ids,
    their rows and its shards' shared rows, `ManagedRows.shard_miss_rows`)."""

    def __init__(self, rows: ManagedRows) -> None:
        super().__init__()
        miss_rows, self.block_size = rows.shard_miss_rows()
        self.register_buffer("sorted_raw_ids", rows._mch_sorted_raw_ids.detach().clone())
        self.register_buffer("rows", rows._mch_remapped_ids_mapping.detach().clone())
        self.register_buffer("miss_rows", miss_rows)

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        return remap_raw_ids(values, self.sorted_raw_ids, self.rows, self.miss_rows, self.block_size)


def served_tables(collection: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, RawIdRemap]]:
    """What a serving program reads of a (split) table collection: each table's weight by table
    name, and a `RawIdRemap` for each managed feature by feature name (none for the others)."""
    plain, managed = (
        (collection.plain, collection.managed) if isinstance(collection, _SplitTables) else (collection, None)
    )
    weights = dict(_weights(plain)) if plain is not None else {}
    remaps: dict[str, RawIdRemap] = {}
    if managed is not None:
        weights.update(_weights(managed._embedding_module))
        modules = managed._managed_collision_collection._managed_collision_modules
        for table, features in managed._managed_collision_collection._table_to_features.items():
            remap = RawIdRemap(modules[table])
            remaps.update(dict.fromkeys(features, remap))
    return weights, remaps


def _weights(tables: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    bags = isinstance(tables, EmbeddingBagCollection)
    for name, module in (tables.embedding_bags if bags else tables.embeddings).items():
        yield name, module.weight


def managed_rows(model: nn.Module) -> Iterator[tuple[str, ManagedRows]]:
    """Every `ManagedRows` of `model` (sharded or not) by qualified name."""
    for fqn, module in model.named_modules():
        if isinstance(module, ManagedRows):
            yield fqn, module


@contextmanager
def counting_paused(modules: Sequence[nn.Module]) -> Iterator[None]:
    """The managed tables of `modules` look ids up without counting them or evicting (as in
    evaluation) inside the block: for a lookup that runs again on a state that already counted
    it (a resumed semi-synchronous plan's lookup in flight at the checkpoint)."""
    rows = [r for module in modules for _, r in managed_rows(module)]
    modes = [r.training for r in rows]
    for r in rows:
        r.training = False
    try:
        yield
    finally:
        for r, mode in zip(rows, modes, strict=True):
            r.training = mode


def plan_buckets(model: nn.Module, world_size: int) -> None:
    """Tell torchrec's planner that each managed table splits into `world_size` buckets. Its
    planner refuses a managed table whose bucket count (`buckets()`, 1 as built) is not a
    multiple of the ranks; the count is a planning hint only: the sharded modules split the
    rows and the raw id space by rank (`rebuild_with_output_id_range`)."""
    for _, rows in managed_rows(model):
        rows._buckets = world_size


def managed_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The managed-collision table modules of `model` by qualified name."""
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, MANAGED_TABLE_TYPES)}


def _collision_collection(
    configs: Sequence[EmbeddingBagConfig | EmbeddingConfig], managed: Mapping[str, Any]
) -> ManagedCollisionCollection:
    """One `ManagedRows` per table, as its feature's `ManagedIds` (`managed[feature]`) says."""
    modules = {}
    for config in configs:
        ids = managed[config.feature_names[0]].ids
        modules[config.name] = ManagedRows(
            uncounted=[f for f in config.feature_names if not managed[f].counted],
            zch_size=config.num_embeddings,
            device=torch.device("meta") if _on_meta() else torch.device("cpu"),
            eviction_policy=eviction_policy(ids.eviction_policy),
            eviction_interval=ids.eviction_interval,
            input_hash_size=ids.input_hash_size,
            name=config.name,
        )
    return ManagedCollisionCollection(modules, list(configs))


def _on_meta() -> bool:
    return torch.empty(0).is_meta


def _split(
    configs: Sequence[EmbeddingBagConfig | EmbeddingConfig], managed: Mapping[str, Any]
) -> tuple[list[Any], list[Any]]:
    """The table configs whose features are plain, and those whose features are managed (a table
    is managed when its features are; torchrec's module manages whole tables)."""
    plain, kept = [], []
    for config in configs:
        kinds = {f in managed for f in config.feature_names}
        if len(kinds) > 1:
            raise ValueError(f"table {config.name} mixes managed and other features: {config.feature_names}")
        (kept if kinds.pop() else plain).append(config)
    return plain, kept


class _SplitTables(nn.Module):
    """A table collection in two parts: `plain` (torchrec's collection, or None) and `managed`
    (its managed-collision twin), both called on the whole KJT (each takes its own features)."""

    def __init__(self, plain: nn.Module | None, managed: nn.Module) -> None:
        super().__init__()
        self.plain = plain
        self.managed = managed

    def _configs(self, method: str) -> list[Any]:
        plain = getattr(self.plain, method)() if self.plain is not None else []
        return [*plain, *getattr(self.managed._embedding_module, method)()]

    def _parts(self, features: KeyedJaggedTensor) -> tuple[Any, Any]:
        managed, _ = self.managed(features)  # (embeddings, remapped ids: not asked for)
        return self.plain(features) if self.plain is not None else None, managed


class SplitBagCollection(_SplitTables):
    """An `EmbeddingBagCollection` in two parts (`_SplitTables`: an `EmbeddingBagCollection` and a
    `ManagedCollisionEmbeddingBagCollection`); `forward` returns one `KeyedTensor` of every
    feature, as the collection it replaces, so a model written for one collection (torchrec's
    `DLRM`) takes it as is."""

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs("embedding_bag_configs")

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return _joined_bags(*self._parts(features))


@torch.fx.wrap
def _joined_bags(plain: Any, managed: Any) -> KeyedTensor:
    """One KeyedTensor of the two parts' pooled embeddings (a leaf of torchrec's FX tracing; a
    sharded part's output is waited for here)."""
    parts = [_waited(p) for p in (plain, managed) if p is not None]
    if len(parts) == 1:
        return parts[0]
    return KeyedTensor(
        keys=[k for p in parts for k in p.keys()],  # noqa: SIM118 (a KeyedTensor is no dict)
        length_per_key=[n for p in parts for n in p.length_per_key()],
        values=torch.cat([p.values() for p in parts], dim=1),
        key_dim=1,
    )


class SplitCollection(_SplitTables):
    """An `EmbeddingCollection` in two parts (`SplitBagCollection`'s unpooled twin): `forward`
    returns one dict of every feature's `JaggedTensor`s."""

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._configs("embedding_configs")

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        return _joined_sequences(*self._parts(features))


@torch.fx.wrap
def _joined_sequences(plain: Any, managed: Any) -> dict[str, JaggedTensor]:
    joined: dict[str, JaggedTensor] = {}
    for part in (plain, managed):
        if part is not None:
            joined.update(_waited(part))
    return joined


def _waited(value: Any) -> Any:
    return value.wait() if isinstance(value, Awaitable) else value


#: evicted rows are re-initialised in place without autograd's version check: a plan may have
#: looked a batch up (its backward still to come) when the next batch's lookup evicts rows
#: (semi-synchronous plans), as torchrec's flag is meant for
_IN_PLACE = {"allow_in_place_embed_weight_update": True}


def split_bag_collection(
    configs: Sequence[EmbeddingBagConfig], managed: Mapping[str, Any]
) -> EmbeddingBagCollection | SplitBagCollection:
    """The tables `configs` as one collection: an `EmbeddingBagCollection` when no feature is in
    `managed` (`DataSpec.managed`), else a `SplitBagCollection` whose managed part holds the
    tables of the managed features."""
    plain, kept = _split(configs, managed)
    if not kept:
        return EmbeddingBagCollection(tables=list(configs))
    bags = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables=kept), _collision_collection(kept, managed), **_IN_PLACE
    )
    return SplitBagCollection(EmbeddingBagCollection(tables=plain) if plain else None, bags)


def split_collection(
    configs: Sequence[EmbeddingConfig], managed: Mapping[str, Any], device: torch.device | None = None
) -> EmbeddingCollection | SplitCollection:
    """`split_bag_collection` for unpooled tables (`EmbeddingCollection`)."""
    plain, kept = _split(configs, managed)
    if not kept:
        return EmbeddingCollection(tables=list(configs), device=device)
    tables = ManagedCollisionEmbeddingCollection(
        EmbeddingCollection(tables=kept, device=device), _collision_collection(kept, managed), **_IN_PLACE
    )
    return SplitCollection(EmbeddingCollection(tables=plain, device=device) if plain else None, tables)
