"""`ModelConfig`, the base of every model's config, and the model protocol.

A model is chosen by `model.name` (see `recsys_pipe.models.registry`). Its config class, next
to the model's code, validates the `model.*` keys and builds the model for a data source:

    cfg.build(spec: DataSpec) -> nn.Module     # unsharded; the trainer shards its tables
    module.forward(batch) -> (loss, outputs)   # outputs: "logits" and "labels" for the metrics,
                                               # "loss_sum" for global-token normalisation

Batches are torchrec `Pipelineable`s whose sparse features are a `KeyedJaggedTensor` attribute,
so torchrec's pipeline can run the input distribution ahead of the forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, StrictStr

from recsys_pipe.config import ConfigProblem, Section

if TYPE_CHECKING:
    from torch import nn

    from recsys_pipe.data import DataConfig, DataSpec

__all__ = ["ModelConfig"]


class ModelConfig(Section):
    """What every model config has (`model.*`)."""

    name: StrictStr = Field(description="model: a name registered in recsys_pipe.models.registry")
    sharding: Literal["table_wise", "row_wise"] = Field(
        "table_wise", description="how the embedding tables are sharded over ranks: table_wise | row_wise"
    )
    loss_normalization: Literal["local", "global_tokens"] = Field(
        "local",
        description="local: mean over this rank's loss tokens; global_tokens: divide by the token count over "
        "all ranks (adds an all-reduce task to the plan; for variable candidate counts)",
    )

    def build(self, spec: DataSpec) -> nn.Module:
        """The model for a data source with these vocabulary sizes (unsharded, on the CPU)."""
        raise NotImplementedError(f"model '{self.name}' does not implement build(spec)")

    def check_data(self, data: DataConfig) -> list[ConfigProblem]:
        """Problems with using this model on `data` (cross-section constraints); none by default."""
        return []
