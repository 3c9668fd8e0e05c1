"""HSTU for next-item retrieval (`model=hstu_retrieval`): the ranking model's HSTU blocks
(`recsys_pipe.models.hstu.HSTULayer` with its relative position/time bias) as the causal encoder
of `recsys_pipe.models.retrieval`, trained by default as in the HSTU paper (sampled softmax,
L2-normalised vectors, temperature 0.05).

Input tokens are the item embeddings scaled by sqrt(d) plus learned absolute position
embeddings; the blocks run on jagged tokens (padding never enters LayerNorm or projections), the
attention causal over each sequence; a final LayerNorm gives the position vectors.
"""

from __future__ import annotations

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
from torch import nn

from recsys_pipe.data.spec import DataSpec
from recsys_pipe.models.dropout import Dropout
from recsys_pipe.models.hstu import HSTULayer, RelativeBias
from recsys_pipe.models.retrieval import RetrievalModel
from recsys_pipe.models.retrieval_config import HSTURetrievalConfig

__all__ = ["HSTURetrievalConfig", "HSTURetrievalEncoder", "build_hstu_retrieval"]


def build_hstu_retrieval(cfg: HSTURetrievalConfig, spec: DataSpec) -> RetrievalModel:
    """Builder of `model.name=hstu_retrieval`."""
    return RetrievalModel(cfg, spec, HSTURetrievalEncoder)


class HSTURetrievalEncoder(nn.Module):
    """Left-padded item embeddings `[B, N, D]` -> one vector per position `[B, N, D]`."""

    def __init__(self, cfg: HSTURetrievalConfig) -> None:
        super().__init__()
        n, d = cfg.max_seq_len, cfg.embedding_dim
        self.max_len = n
        self.scale = d**0.5
        self.position = nn.Embedding(n, d)
        self.dropout = Dropout(cfg.dropout)
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
