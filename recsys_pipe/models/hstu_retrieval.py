"""HSTU for next-item retrieval (`model=hstu_retrieval`): the ranking model's HSTU blocks
(`recsys_pipe.models.hstu.HSTULayer` with its relative position/time bias) as the causal encoder
of `recsys_pipe.models.retrieval`, trained by default as in the HSTU paper (sampled softmax,
L2-normalised vectors, temperature 0.05).

Input tokens are the item embeddings scaled by sqrt(d) plus learned absolute position
embeddings; the blocks run on jagged tokens (padding never enters LayerNorm or projections), the
attention causal over each sequence; a final LayerNorm gives the position vectors.
"""

from __future__ import annotations

from typing import Literal

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationInfo, field_validator
from torch import nn

from recsys_pipe.config import builder_field
from recsys_pipe.data.spec import DataSpec
from recsys_pipe.models.hstu import HSTULayer, RelativeBias
from recsys_pipe.models.retrieval import RetrievalConfig, RetrievalModel

__all__ = ["HSTURetrievalConfig", "HSTURetrievalEncoder", "build_hstu_retrieval"]


class HSTURetrievalConfig(RetrievalConfig):
    """`model=hstu_retrieval`: sizes of the HSTU encoder (`model.*`)."""

    name: Literal["hstu_retrieval"] = "hstu_retrieval"
    builder: StrictStr | None = builder_field("recsys_pipe.models.hstu_retrieval:build_hstu_retrieval")
    loss: Literal["bce", "sampled_softmax"] = Field(
        "sampled_softmax",
        description="bce: one sampled negative per position (SASRec); sampled_softmax: N shared negatives",
    )
    dropout: float = Field(0.2, ge=0, lt=1, description="dropout on embeddings and blocks")
    num_layers: StrictInt = Field(2, ge=1, description="HSTU blocks")
    num_heads: StrictInt = Field(1, ge=1, description="attention heads (must divide embedding_dim)")
    relative_bias: StrictBool = Field(True, description="learned relative position/time attention bias")
    num_time_buckets: StrictInt = Field(64, ge=1, description="log time-gap buckets of the relative bias")

    @field_validator("num_heads")
    @classmethod
    def _heads_divide_width(cls, num_heads: int, info: ValidationInfo) -> int:
        dim = info.data.get("embedding_dim")
        if isinstance(dim, int) and dim % num_heads:
            raise ValueError(f"embedding_dim ({dim}) is not divisible by num_heads ({num_heads})")
        return num_heads

    def encoder(self, spec: DataSpec) -> nn.Module:
        return HSTURetrievalEncoder(self)


def build_hstu_retrieval(cfg: HSTURetrievalConfig, spec: DataSpec) -> RetrievalModel:
    """Builder of `model.name=hstu_retrieval`."""
    return RetrievalModel(cfg, spec)


class HSTURetrievalEncoder(nn.Module):
    """Left-padded item embeddings `[B, N, D]` -> one vector per position `[B, N, D]`."""

    def __init__(self, cfg: HSTURetrievalConfig) -> None:
        super().__init__()
        n, d = cfg.max_seq_len, cfg.embedding_dim
        self.max_len = n
        self.scale = d**0.5
        self.position = nn.Embedding(n, d)
        self.dropout = nn.Dropout(cfg.dropout)
        self.bias = RelativeBias(n, cfg.num_time_buckets) if cfg.relative_bias else None
        self.layers = nn.ModuleList(HSTULayer(cfg, n) for _ in range(cfg.num_layers))  # type: ignore[arg-type]
        self.final_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, timestamps: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        n = self.max_len
        lengths = valid.sum(dim=1)
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        tokens = self.dropout(x[valid] * self.scale + self.position.weight[None].expand(x.shape[0], -1, -1)[valid])
        # the blocks pad on the right: sequence positions 0 .. length-1, causal over valid tokens
        pos = torch.arange(n, device=x.device)
        right_valid = pos[None] < lengths[:, None]
        mask = (right_valid[:, :, None] & right_valid[:, None, :] & (pos[:, None] >= pos[None, :])).float()
        bias = None
        if self.bias is not None:
            padded_ts = torch.ops.fbgemm.jagged_1d_to_dense(timestamps[valid], offsets, n, 0)
            bias = self.bias(padded_ts)
        for layer in self.layers:
            tokens = layer(tokens, offsets, mask, bias)
        out = x.new_zeros(x.shape)
        out[valid] = self.final_norm(tokens)
        return out
