"""What training does about `ids: managed` features (docs/raw-ids.md) besides building the
model: the pre-flight refusals, and the part of the tables' state torchrec does not checkpoint.

Refused before any process starts, each with one line naming the key:

* a layout without torchrec's managed-collision modules (`refuse_managed`, called by each
  `Parallelism` that cannot hold them: plain torch tables, `dlrm_torch`; tables on torchrec's
  dense kernel), or a model that builds no managed-collision table for the feature
  (`check_model`), at the feature's `ids`;
* `model.compute_kernel=dense` (the managed-collision sharders offer the fused kernel only);
* a table too small for the policy: every row-wise shard keeps its last row for the ids without
  one, so each shard needs two rows at least, at the key of the feature's rows;
* a resume (or `recsys-eval`) on another number of ranks: each rank's shard of a managed table
  holds the raw ids of its slice of the id space, and the slices move with the rank count;
  the remapping is not resharded (`check_resume_ranks`), at `trainer.resume_from`.

A checkpoint holds a managed table's weights, its remapping and the eviction policy's counts or
ages (torchrec's buffers, sharded with the table by DCP), and, in each rank's own file, the ids
counted since the last eviction (`history_state`), which torchrec keeps in memory only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from recsys_pipe.config import ConfigError, ConfigProblem

__all__ = [
    "MANAGED_STATE_KEY",
    "check_model",
    "check_resume_ranks",
    "history_state",
    "load_history_state",
    "refuse_managed",
]

#: the key of the managed tables' history in a rank's own checkpoint file
MANAGED_STATE_KEY = "managed_ids"
#: a word of the DCP key of every managed table's remapping (torchrec's buffer)
_REMAP_BUFFER = "_mch_sorted_raw_ids"


def refuse_managed(spec: Any, why: str) -> None:
    """ConfigError at the first managed feature's `ids` (`spec` is the data's `DataSpec`): this
    layout cannot train managed ids, because `why`."""
    if spec.managed:
        feature, managed = next(iter(spec.managed.items()))
        raise ConfigError(ConfigProblem(managed.problem_key("ids"), f"ids=managed (feature {feature!r}): {why}"))


def check_model(spec: Any, model: nn.Module, kernel: str, plan: Any) -> None:
    """The pre-flight of a sharded model (built on the meta device) with managed features: each
    is looked up through a managed-collision table, on the fused kernel, and every row-wise
    shard of `plan` (torchrec's `ShardingPlan`) has two rows at least (module docstring)."""
    if not spec.managed:
        return
    from recsys_pipe.models.managed import managed_modules
    from recsys_pipe.models.sharding import table_features

    managed = {fqn: table_features(m) for fqn, m in managed_modules(model).items()}
    covered = {f for tables in managed.values() for features in tables.values() for f in features}
    missing = [f for f in spec.managed if f not in covered]
    if missing:
        refuse_managed(
            _only(spec, missing),
            "the model builds no managed-collision table for it (torchrec's ManagedCollisionEmbeddingBagCollection / "
            "ManagedCollisionEmbeddingCollection); the shipped models that do: dlrm, dlrm_dcn, hstu, hstu_small, "
            "sasrec, hstu_retrieval",
        )
    if kernel != "fused":
        raise ConfigError(
            ConfigProblem(
                "model.compute_kernel",
                f"{kernel} is not offered for managed-collision tables (ids=managed): torchrec's sharders of them "
                "offer the fused kernel only; use model.compute_kernel=fused",
            )
        )
    for fqn, tables in managed.items():
        for table, features in tables.items():
            _check_shard_rows(spec.managed[features[0]], table, plan.plan[fqn][table])


def _only(spec: Any, features: list[str]) -> Any:
    """`spec` with only `features` managed (to report the first of them)."""
    import dataclasses

    return dataclasses.replace(spec, managed={f: spec.managed[f] for f in features})


def _check_shard_rows(managed: Any, table: str, sharding: Any) -> None:
    """ConfigError at `num_embeddings` where a row-wise shard of `table` has fewer than 2 rows."""
    shards = [m.shard_sizes[0] for m in sharding.sharding_spec.shards] if sharding.sharding_spec else []
    rows = sum(shards)
    if shards and min(shards) < 2:
        raise ConfigError(
            ConfigProblem(
                managed.rows_key,
                f"table {table} has {rows} rows, split over {len(shards)} rank(s) into shards of {shards} rows: each "
                "shard of a managed table keeps its last row for the ids without a row of their own, so it needs 2 "
                f"rows at least ({2 * len(shards)} rows or more for {len(shards)} rank(s))",
            )
        )


def check_resume_ranks(path: Path | None, world_size: int, key: str = "trainer.resume_from") -> None:
    """ConfigError at `key` if the checkpoint at `path` holds managed tables written by another
    number of ranks than `world_size` (module docstring)."""
    if path is None:
        return
    from recsys_pipe.train.checkpoint import read_metadata, saved_world_size

    metadata = read_metadata(path)
    if not any(_REMAP_BUFFER in key for key in metadata.state_dict_metadata):
        return
    saved = saved_world_size(metadata)
    if saved != world_size:
        raise ConfigError(
            ConfigProblem(
                key,
                f"checkpoint {path} holds managed-collision tables (ids=managed) of {saved} rank(s), this run has "
                f"{world_size}: each rank's shard holds the raw ids of its slice of the id space, which moves with "
                f"the rank count, so the remapping is not resharded; run on {saved} rank(s)",
            )
        )


def history_state(model: nn.Module) -> dict[str, Any]:
    """The ids counted since the last eviction by every managed table of `model` on this rank
    (`ManagedRows.history_state`), by module name; empty without managed tables."""
    from recsys_pipe.models.managed import managed_rows

    return {fqn: rows.history_state() for fqn, rows in managed_rows(model)}


def load_history_state(model: nn.Module, state: Mapping[str, Any]) -> None:
    """Restore `history_state(model)` as a checkpoint saved it."""
    from recsys_pipe.models.managed import managed_rows

    for fqn, rows in managed_rows(model):
        if fqn in state:
            rows.load_history_state(state[fqn])
