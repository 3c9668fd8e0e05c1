"""The HSTU ranker's config (`model=hstu_small`), apart from the model code: the registry imports
it to validate `model.*` and to generate its defaults (`recsys_pipe.config.structured`) without
loading torchrec, which the model itself needs."""

from __future__ import annotations

import os
from typing import ClassVar, Literal

import torch
from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator

from recsys_pipe.config import ConfigProblem, builder_field
from recsys_pipe.data.batch import SequenceBatch
from recsys_pipe.data.source import DataConfig, SequenceDataConfig
from recsys_pipe.models.base import ShardedModelConfig, StageSplit, heads_divide_width

__all__ = ["HSTUConfig"]


class HSTUConfig(ShardedModelConfig):
    """`model=hstu_small`: sizes of the HSTU ranker (`model.*`). Vocabulary sizes come from the
    data source's `DataSpec`."""

    #: pipeline stages share out the HSTU blocks (`recsys_pipe.models.hstu_cut.hstu_stages`)
    stage_split: ClassVar[StageSplit] = StageSplit("num_layers", "recsys_pipe.models.hstu_cut:hstu_stages")

    #: the sources of `Sample`s (windows with candidates and labels): movielens, synthetic, parquet_sequences
    data_kind: ClassVar[type[DataConfig] | None] = SequenceDataConfig

    name: Literal["hstu"] = "hstu"
    builder: StrictStr | None = builder_field("recsys_pipe.models.hstu:build_hstu")
    embedding_dim: StrictInt = Field(32, ge=1, description="embedding and model width")
    num_layers: StrictInt = Field(2, ge=1, description="HSTU blocks")
    num_heads: StrictInt = Field(2, ge=1, description="attention heads (must divide embedding_dim)")
    max_seq_len: StrictInt = Field(
        32, ge=2, description="static padded attention length in item tokens; must be >= data.max_seq_len"
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on tokens and attention outputs")
    relative_bias: StrictBool = Field(True, description="learned relative position/time attention bias")
    num_time_buckets: StrictInt = Field(64, ge=1, description="log time-gap buckets of the relative bias")
    attention: Literal["auto", "padded", "triton"] = Field(
        "auto",
        description="how attention runs: padded (pads each batch to [B, N, N], torch ops), triton (fused jagged "
        "Triton kernels: CUDA, or the CPU under TRITON_INTERPRET=1), auto (triton on CUDA where Triton imports, "
        "else padded); the same function either way",
    )

    _heads_divide_width = field_validator("num_heads")(heads_divide_width)

    def check_data(self, data: DataConfig) -> list[ConfigProblem]:
        if not isinstance(data, SequenceDataConfig):
            return [ConfigProblem("data.name", f"model 'hstu' needs a sequence data source, got '{data.name}'")]
        if data.max_seq_len > self.max_seq_len:
            return [
                ConfigProblem(
                    "data.max_seq_len",
                    f"{data.max_seq_len} exceeds model.max_seq_len ({self.max_seq_len}), the model's padded "
                    "attention length: longer sequences would be cut",
                )
            ]
        return []

    def check_device(self, device_type: str) -> list[ConfigProblem]:
        """`model.attention=triton` needs Triton, and a device its kernels run on: CUDA, or the CPU
        in Triton's interpreter (`TRITON_INTERPRET=1`, slow: for tests)."""
        if self.attention != "triton":
            return []
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return [
                ConfigProblem(
                    "model.attention",
                    f"triton needs the triton package, which does not import here ({exc}); use padded or auto",
                )
            ]
        interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if device_type == "cuda" and interpreted:
            return [
                ConfigProblem(
                    "model.attention",
                    "triton on CUDA is compiled, but TRITON_INTERPRET is set (the interpreter runs on CPU tensors "
                    "only); unset it, or use padded",
                )
            ]
        if device_type != "cuda" and not interpreted:
            return [
                ConfigProblem(
                    "model.attention",
                    f"triton runs its kernels on CUDA, and this run trains on {device_type}; use padded or auto "
                    "(or set TRITON_INTERPRET=1 to run them in Triton's slow CPU interpreter, for tests)",
                )
            ]
        return []

    def sample_costs(self, batch: SequenceBatch) -> torch.Tensor:
        """Compute cost of each sample of `batch`, for the balanced batch shuffler: the forward
        FLOPs of `num_layers` HSTU blocks on its `n` tokens (items plus the user token) at width
        `d`, `num_layers * (4 n^2 d + 10 n d^2)`. Per block, `2 n^2 d` multiply-adds for the
        attention scores and the weighted sum of values, and `5 n d^2` for the fused u,v,q,k
        projection (`4 d^2` per token) and the output projection (`d^2`); the backward pass
        scales both terms alike. The quadratic term makes long sequences dominate, as they do in
        jagged attention kernels on the GPU (`model.attention=triton`); the padded attention pads to
        `max_seq_len`, so there its attention time does not depend on the lengths.)"""
        n = batch.sequence_lengths().to(torch.float64)
        d = float(self.embedding_dim)
        return self.num_layers * (4.0 * n * n * d + 10.0 * n * d * d)
