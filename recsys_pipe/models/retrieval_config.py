"""The retrieval models' configs (`model=sasrec`, `model=hstu_retrieval`), apart from the model
code: the registry imports them to validate `model.*` and to generate their defaults
(`recsys_pipe.config.structured`) without loading torchrec, which the models need."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator

from recsys_pipe.config import ConfigProblem, builder_field
from recsys_pipe.data.batch import INPUT_KEY, DataSpec
from recsys_pipe.data.source import DataConfig, SequenceSourceConfig
from recsys_pipe.models.base import ShardedModelConfig, StageSplit, heads_divide_width

__all__ = ["HSTURetrievalConfig", "RetrievalConfig", "SASRecConfig"]


class RetrievalConfig(ShardedModelConfig):
    """What every retrieval model has (`model.*`): width, sequence length, loss."""

    #: next-item retrieval sources: sequences, parquet_sequences
    data_kind: ClassVar[type[DataConfig] | None] = SequenceSourceConfig

    embedding_dim: StrictInt = Field(50, ge=1, description="item embedding and model width")
    max_seq_len: StrictInt = Field(50, ge=1, description="positions of the encoder; must be >= data.max_seq_len")
    dropout: float = Field(0.5, ge=0, lt=1, description="dropout on embeddings and blocks")
    loss: Literal["bce", "sampled_softmax"] = Field(
        "bce",
        description="bce: one sampled negative per position (SASRec); sampled_softmax: softmax over the target and "
        "num_negatives negatives (model.negatives)",
    )
    num_negatives: StrictInt = Field(
        128, ge=1, description="sampled_softmax: negatives each position scores (model.negatives says whose)"
    )
    negatives: Literal["per_position", "shared"] = Field(
        "per_position",
        description="sampled_softmax: per_position: every position scores num_negatives negatives of its own, drawn "
        "by the data (generative-recommenders' recipe); shared: every position of a batch scores one pool, the "
        "batch's first num_negatives negatives (the data draws one per target: cheaper)",
    )
    temperature: float = Field(0.05, gt=0, description="sampled_softmax: logits are cosine / temperature")

    @property
    def per_position_negatives(self) -> bool:
        """Whether each position of the loss scores negatives of its own (the sampled softmax with
        `negatives=per_position`); bce also has its own, one per position."""
        return self.loss == "sampled_softmax" and self.negatives == "per_position"

    @property
    def negatives_per_target(self) -> int:
        """How many negatives the data draws per target, derived from the loss: `num_negatives`
        for per-position sampled softmax, else one (bce's negative; the shared pool is cut from
        the batch's one-per-target negatives)."""
        return self.num_negatives if self.per_position_negatives else 1

    def data_for_model(self, data: DataConfig) -> DataConfig:
        """`data` drawing `negatives_per_target` training negatives per target (derived here,
        never a key of its own)."""
        if isinstance(data, SequenceSourceConfig):
            return data.with_negatives_per_target(self.negatives_per_target)
        return data  # another source: check_data reports it

    def item_init(self, num_items: int) -> tuple[float, bool]:
        """(std, truncated) of the item table's normal initialisation: Xavier-normal's std for
        its shape (SASRec's code), not truncated."""
        return math.sqrt(2.0 / (num_items + self.embedding_dim)), False

    def check_data(self, data: DataConfig) -> list[ConfigProblem]:
        if not isinstance(data, SequenceSourceConfig):
            return [ConfigProblem("data.name", f"model '{self.name}' needs data=sequences, got '{data.name}'")]
        if data.max_seq_len > self.max_seq_len:
            return [
                ConfigProblem("data.max_seq_len", f"{data.max_seq_len} exceeds model.max_seq_len ({self.max_seq_len})")
            ]
        return []

    def check_spec(self, spec: DataSpec) -> list[ConfigProblem]:
        others = spec.vocab_sizes[INPUT_KEY] - 1
        if self.loss == "sampled_softmax" and self.negatives == "shared" and self.num_negatives > others:
            return [
                ConfigProblem(
                    "model.num_negatives",
                    f"{self.num_negatives} shared negatives per batch, but the data has {others + 1} items: at most "
                    f"{others} can be negatives of a position",
                )
            ]
        return []


class SASRecConfig(RetrievalConfig):
    """`model=sasrec`: the SASRec encoder's sizes (`model.*`); the item count comes from the data."""

    #: pipeline stages share out the self-attention blocks (`recsys_pipe.models.retrieval_cut.sasrec_stages`)
    stage_split: ClassVar[StageSplit] = StageSplit("num_blocks", "recsys_pipe.models.retrieval_cut:sasrec_stages")

    name: Literal["sasrec"] = "sasrec"
    builder: StrictStr | None = builder_field("recsys_pipe.models.sasrec:build_sasrec")
    num_blocks: StrictInt = Field(2, ge=1, description="self-attention blocks")
    num_heads: StrictInt = Field(1, ge=1, description="attention heads (must divide embedding_dim)")
    norm_first: StrictBool = Field(
        False,
        description="pre-LN blocks: LayerNorm before attention and before feed-forward, unnormalised residuals "
        "(false: the paper's layout)",
    )

    _heads_divide_width = field_validator("num_heads")(heads_divide_width)


class HSTURetrievalConfig(RetrievalConfig):
    """`model=hstu_retrieval`: sizes of the HSTU encoder (`model.*`)."""

    #: pipeline stages share out the HSTU blocks (`recsys_pipe.models.retrieval_cut.hstu_retrieval_stages`)
    stage_split: ClassVar[StageSplit] = StageSplit(
        "num_layers", "recsys_pipe.models.retrieval_cut:hstu_retrieval_stages"
    )

    name: Literal["hstu_retrieval"] = "hstu_retrieval"
    builder: StrictStr | None = builder_field("recsys_pipe.models.hstu_retrieval:build_hstu_retrieval")
    loss: Literal["bce", "sampled_softmax"] = Field(
        "sampled_softmax",
        description="bce: one sampled negative per position (SASRec); sampled_softmax: softmax over the target and "
        "num_negatives negatives (model.negatives)",
    )
    dropout: float = Field(0.2, ge=0, lt=1, description="dropout on embeddings and blocks")
    num_layers: StrictInt = Field(2, ge=1, description="HSTU blocks")
    num_heads: StrictInt = Field(1, ge=1, description="attention heads (must divide embedding_dim)")
    relative_bias: StrictBool = Field(True, description="learned relative position/time attention bias")
    num_time_buckets: StrictInt = Field(128, ge=1, description="log time-gap buckets of the relative bias")

    _heads_divide_width = field_validator("num_heads")(heads_divide_width)

    def item_init(self, num_items: int) -> tuple[float, bool]:
        """N(0, 0.02) truncated at two standard deviations (generative-recommenders' item table)."""
        return 0.02, True
