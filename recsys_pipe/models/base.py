"""The model protocol, `ModelConfig` (the base of every model's config) and `ShardedModelConfig`.

A model is a builder function and the config class of its keys (see `recsys_pipe.config.registry`):

    def build(cfg: MyConfig, spec: DataSpec) -> nn.Module      # unsharded, on the CPU
    module.forward(batch) -> (loss, outputs)

* `batch` is what the data source's collate function made, moved to the device: a torchrec
  `Pipelineable` (see `recsys_pipe.data.batch` for the whole batch protocol). A model with
  torchrec tables reads its sparse features from the batch attribute `sparse_features`, a
  `KeyedJaggedTensor`, so torchrec's pipeline can run their input distribution ahead of the
  forward.
* `loss`: a scalar, the quantity to minimise on this rank's batch.
* `outputs["logits"]`, `outputs["labels"]`: `[N, num_tasks]` scores and 0/1 targets of the N
  scored rows (samples, or candidates of sequence models), for AUC and log loss.
* `outputs["loss_sum"]`: the loss summed over the `batch.num_loss_tokens()` terms it averages,
  used instead of `loss` when `model.loss_normalization=global_tokens`.

A model's module may name its dense submodules (`DenseSubmodules`): what `trainer.compile=true`
compiles, the torchrec tables being left to torchrec.

The config class decides how the tables are distributed: a `ShardedModelConfig` model has torchrec
tables (`EmbeddingCollection` / `EmbeddingBagCollection`) that `DistributedModelParallel` shards
(`model.sharding`); a plain `ModelConfig` model has plain torch tables and is replicated under
DDP (small vocabularies), and then needs no torchrec at all.

A model that can be cut into pipeline stages (`parallel.pp`) says how in its config class
(`ModelConfig.stage_split`, a `StageSplit`): which key counts the layers the stages share, and
the function that cuts a built model into stage modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator

from recsys_pipe.config import Component, ConfigProblem, import_fn

if TYPE_CHECKING:
    from torch import nn

    from recsys_pipe.data import DataConfig, DataSpec

__all__ = [
    "SHARDING_TYPES",
    "DenseSubmodules",
    "ModelConfig",
    "ShardedModelConfig",
    "ShardingType",
    "StageSplit",
    "heads_divide_width",
]

#: torchrec sharding types a table can be constrained to (`model.sharding_constraints`).
ShardingType = Literal["row_wise", "column_wise", "table_wise", "table_column_wise", "table_row_wise", "data_parallel"]
SHARDING_TYPES: tuple[str, ...] = ShardingType.__args__


@runtime_checkable
class DenseSubmodules(Protocol):
    """A model module that names its dense submodules: the part after the embedding lookup
    (replicated under DDP), which `trainer.compile=true` compiles in place; the torchrec tables
    stay torchrec's. Every shipped model implements it; a custom model without it cannot be
    compiled (exit 2 naming `trainer.compile`). Name modules of the model's own classes:
    torch.compile skips a bare torch.nn module (an `nn.Sequential`) compiled on its own."""

    def dense_modules(self) -> list[nn.Module]:
        """The submodules to compile, each called by the model's forward."""
        ...


@dataclass(frozen=True)
class StageSplit:
    """How a model is cut into pipeline stages: `layers` is the config key (under `model.`)
    counting the layers the stages share out, `cut` the function (`module:function`, imported
    when a run is cut) that turns a built model and each stage's layer indices into the stage
    modules, `cut(model, [[0, 1], [2]]) -> [stage0, stage1]`."""

    layers: str
    cut: str


def heads_divide_width(num_heads: int, info: ValidationInfo) -> int:
    """A `num_heads` validator for attention models: the heads split `embedding_dim` evenly.
    Use as `_heads = field_validator("num_heads")(heads_divide_width)`."""
    dim = info.data.get("embedding_dim")
    if isinstance(dim, int) and dim % num_heads:
        raise ValueError(f"embedding_dim ({dim}) is not divisible by num_heads ({num_heads})")
    return num_heads


class ModelConfig(Component):
    """What every model config has (`model.*`). A builder whose config parameter is not
    annotated gets this class: plain torch tables, no extra keys."""

    #: how the model is cut into pipeline stages (`parallel.pp`); None: it cannot be
    stage_split: ClassVar[StageSplit | None] = None
    #: the kind of data source the model trains on: the base class of their configs (None: any).
    #: A source that serves several kinds gives the model its config of this kind
    #: (`DataConfig.as_kind`); `check_data` then checks it.
    data_kind: ClassVar[type[DataConfig] | None] = None

    loss_normalization: Literal["local", "global_tokens"] = Field(
        "local",
        description="local: mean over this rank's loss tokens; global_tokens: divide by the token count over "
        "all ranks (adds an all-reduce task to the plan; for variable candidate counts)",
    )

    def build(self, spec: DataSpec) -> nn.Module:
        """The model for a data source with this spec (unsharded, on the CPU): the builder's result."""
        return self.call_builder("model", spec)

    @property
    def stage_layers(self) -> int | None:
        """The layers the pipeline stages share out (`stage_split.layers`), None if it cannot be cut."""
        return None if self.stage_split is None else getattr(self, self.stage_split.layers)

    def cut_into_stages(self, model: nn.Module, split: Sequence[Sequence[int]]) -> list[nn.Module]:
        """`model` (built from this config) cut into stages holding the layers `split[s]`."""
        if self.stage_split is None:
            raise TypeError(f"model '{self.label}' declares no stage split")
        return import_fn(self.stage_split.cut)(model, split)

    def check_data(self, data: DataConfig) -> list[ConfigProblem]:
        """Problems with using this model on `data` (cross-section constraints); none by default."""
        return []

    def data_for_model(self, data: DataConfig) -> DataConfig:
        """The data config this model trains on: `data` with what the model derives for it (a
        retrieval model: the negatives drawn per target), so no number is set in two keys. Called
        by the run config once `check_data` found no problem; by default `data` as it is."""
        return data

    def check_device(self, device_type: str) -> list[ConfigProblem]:
        """Problems with training this model on `device_type` ("cpu" or "cuda", where the run
        trains), found before any process group starts; none by default."""
        return []

    def check_spec(self, spec: Any) -> list[ConfigProblem]:
        """Problems with using this model on the data as read (its `DataSpec`: vocabulary sizes),
        found by the pre-flight before anything starts; none by default."""
        return []

    def sample_costs(self, batch: Any) -> torch.Tensor:
        """Per-sample compute cost `[B]` (float64, any unit) of a batch, for the balanced batch
        shuffler (`start_shuffle`). By default every sample costs the same: there is nothing to
        balance and the shuffler leaves the batches as loaded. Models whose cost depends on the
        sample (sequence length) override it."""
        return torch.ones(batch.batch_size, dtype=torch.float64, device=batch.sample_ids.device)


class ShardedModelConfig(ModelConfig):
    """A model with torchrec embedding tables, sharded over the ranks by `DistributedModelParallel`."""

    sharding: Literal["table_wise", "row_wise", "column_wise", "table_column_wise", "table_row_wise", "planner"] = (
        Field(
            "table_wise",
            description="table_wise: whole tables round-robin over ranks; row_wise: every table split by rows over "
            "all ranks; column_wise: each table split by columns over several ranks; table_column_wise / "
            "table_row_wise: each table split by columns / rows over the ranks of one host (table_row_wise needs 2+ "
            "hosts); planner: torchrec's EmbeddingShardingPlanner for this topology (with sharding_constraints)",
        )
    )
    sharding_constraints: dict[str, list[ShardingType]] = Field(
        default_factory=dict,
        description="model.sharding=planner only: {table: [allowed sharding types]}, types from row_wise, "
        "column_wise, table_wise, table_column_wise, table_row_wise, data_parallel (null: none)",
    )
    compute_kernel: Literal["fused", "dense"] = Field(
        "fused",
        description="fused: fbgemm updates the tables inside backward with optimizer.sparse; dense: torchrec's dense "
        "kernel, the tables get gradients and the dense optimizer (optimizer.*) updates them with the other weights",
    )

    table_init: Literal["unsharded", "per_shard"] = Field(
        "unsharded",
        description="unsharded: every rank builds the whole tables on the CPU from the seed, then keeps its shards; "
        "per_shard: the tables are built on the meta device and each rank draws only its own shards, by blocks of "
        "rows seeded from the seed (no whole tables in host memory; the same tables at every world size and "
        "sharding type, but other values than unsharded's; not with ids=managed or parallel.pp)",
    )

    @field_validator("sharding_constraints", mode="before")
    @classmethod
    def _null_is_none(cls, value: object) -> object:
        # null in the YAML, so `model.sharding_constraints={t: [...]}` can set it from the command line
        return {} if value is None else value

    @model_validator(mode="after")
    def _constraints_need_planner(self) -> ShardedModelConfig:
        if self.sharding_constraints and self.sharding != "planner":
            raise ValueError(
                f"sharding_constraints are used by torchrec's planner only (model.sharding is '{self.sharding}'); "
                "set model.sharding=planner"
            )
        if self.compute_kernel == "dense" and self.sharding == "planner":
            raise ValueError(
                "compute_kernel=dense needs a hand-built plan (model.sharding=row_wise, table_wise, ...): torchrec's "
                "planner offers the dense kernel for data_parallel tables only"
            )
        empty = [table for table, types in self.sharding_constraints.items() if not types]
        if empty:
            raise ValueError(f"sharding_constraints.{empty[0]}: list at least one sharding type")
        return self
