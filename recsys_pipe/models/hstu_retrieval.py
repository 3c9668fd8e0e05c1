"""HSTU for next-item retrieval (`model=hstu_retrieval`, `model=hstu_retrieval_large`): the
ranking model's HSTU blocks (`recsys_pipe.models.hstu.HSTULayer` with its relative position/time
bias) as the causal encoder of `recsys_pipe.models.retrieval`, trained by default as in the HSTU
paper (sampled softmax, L2-normalised vectors, temperature 0.05).

The encoder computes what generative-recommenders' research `HSTU` computes (its
`LearnablePositionalEmbeddingInputFeaturesPreprocessor`, `HSTUJagged` and
`L2NormEmbeddingPostprocessor`; a test holds the two side by side on the same weights):

* input tokens: item embeddings scaled by sqrt(d) plus learned absolute position embeddings,
  position 0 for a sequence's oldest item, then dropout;
* the blocks on jagged tokens (padding never enters LayerNorm or projections), attention causal
  over each sequence; each block has a relative bias of its own, which for query i and key j
  reads the time of the item that position i predicts (its next item) against the time of item j;
* the output vectors L2-normalised (norm clamped at 1e-6): no final LayerNorm.

`model.max_seq_len` is the padded attention length N, which divides the attention (SiLU / N) and
sizes the position tables: the reference pads to its data length + 11 (its `gr_output_length`
+ 1), so `model.max_seq_len = data.max_seq_len + 11` reproduces it exactly (docs/retrieval.md).
"""

from __future__ import annotations

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
from torch import nn

from recsys_pipe.data.batch import DataSpec
from recsys_pipe.models.dropout import Dropout
from recsys_pipe.models.hstu import HSTULayer, RelativeBias
from recsys_pipe.models.retrieval import RetrievalModel
from recsys_pipe.models.retrieval_config import HSTURetrievalConfig

__all__ = ["OUTPUT_NORM_EPS", "HSTURetrievalConfig", "HSTURetrievalEncoder", "build_hstu_retrieval"]

OUTPUT_NORM_EPS = 1e-6
"""The output vectors' L2 norm is clamped at this (the reference's `L2NormEmbeddingPostprocessor`)."""


def build_hstu_retrieval(cfg: HSTURetrievalConfig, spec: DataSpec) -> RetrievalModel:
    """Builder of `model.name=hstu_retrieval`."""
    return RetrievalModel(cfg, spec, HSTURetrievalEncoder)


class HSTURetrievalEncoder(nn.Module):
    """Left-padded item embeddings `[B, N, D]` -> one L2-normalised vector per position `[B, N, D]`.

    The steps are methods (`geometry`, `embed`, `time_buckets`, `run_layers`, `finish`) so that a
    pipeline stage (`recsys_pipe.models.retrieval_cut`) runs the same code on its share of the layers."""

    def __init__(self, cfg: HSTURetrievalConfig) -> None:
        super().__init__()
        n, d = cfg.max_seq_len, cfg.embedding_dim
        self.max_len = n
        self.scale = d**0.5
        self.position = nn.Embedding(n, d)
        nn.init.xavier_normal_(self.position.weight)  # the reference's HSTU.reset_params
        self.dropout = Dropout(cfg.dropout)
        self.layers = nn.ModuleList(HSTULayer(cfg, n) for _ in range(cfg.num_layers))  # type: ignore[arg-type]
        #: one relative bias per block (the reference gives each block its own), or None
        self.biases = (
            nn.ModuleList(RelativeBias(n, cfg.num_time_buckets) for _ in range(cfg.num_layers))
            if cfg.relative_bias
            else None
        )

    def geometry(self, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From the left-padded `valid` mask `[B, N]`: the jagged token offsets `[B + 1]` and the
        `[B, N, N]` causal mask of the blocks, which pad on the right (sequence positions
        0 .. length - 1)."""
        n = self.max_len
        lengths = valid.sum(dim=1)
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        pos = torch.arange(n, device=valid.device)
        right_valid = pos[None] < lengths[:, None]
        mask = (right_valid[:, :, None] & right_valid[:, None, :] & (pos[:, None] >= pos[None, :])).float()
        return offsets, mask

    def embed(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The first block's input: jagged tokens `[T, D]`, the scaled items plus the position of
        each item in its sequence (the oldest at 0), then dropout."""
        n = self.max_len
        lengths = valid.sum(dim=1)
        index = (torch.arange(n, device=x.device)[None] - (n - lengths)[:, None])[valid]
        return self.dropout(x[valid] * self.scale + self.position.weight[index])

    def time_buckets(self, timestamps: torch.Tensor, valid: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor | None:
        """The `[B, N, N]` time buckets every block's bias reads (`RelativeBias.bucketize`; None
        without a bias). `timestamps` `[B, N + 1]`: the items' times left-padded as the items,
        then the time of the item after the last (`recsys_pipe.models.retrieval.padded_times`)."""
        if self.biases is None:
            return None
        n = self.max_len
        keys = torch.ops.fbgemm.jagged_1d_to_dense(timestamps[:, :n][valid], offsets, n, 0)
        queries = torch.ops.fbgemm.jagged_1d_to_dense(timestamps[:, 1:][valid], offsets, n, 0)
        return self.biases[0].bucketize(keys, queries)

    def run_layers(
        self,
        tokens: torch.Tensor,
        offsets: torch.Tensor,
        mask: torch.Tensor,
        buckets: torch.Tensor | None,
        layers: range | None = None,
    ) -> torch.Tensor:
        """Blocks `layers` (default: all) on jagged tokens, each with its own bias."""
        for i in range(len(self.layers)) if layers is None else layers:
            bias = None if buckets is None or self.biases is None else self.biases[i].from_buckets(buckets)
            tokens = self.layers[i](tokens, offsets, mask, bias)
        return tokens

    def finish(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The last block's jagged output -> left-padded `[B, N, D]` unit vectors (zeros at padding)."""
        norm = torch.linalg.vector_norm(tokens, dim=-1, keepdim=True).clamp(min=OUTPUT_NORM_EPS)
        out = tokens.new_zeros((*valid.shape, tokens.shape[-1]))
        out[valid] = tokens / norm
        return out

    def forward_padded(self, x: torch.Tensor, timestamps: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`forward` on the left-padded tensors as they are, with no jagged operator: the serving
        program (`RetrievalModel.serving`), which then loads with torch alone.

        Why it equals `forward` at the valid positions: every token-wise step is the same, and
        the attention sees the same keys at the same relative positions. The relative bias reads
        `j - i` and the time gaps, which a shift of the sequence leaves as they are; the mask keeps
        padding keys out (padding queries compute junk that `finish`'s zeros replace). A
        program of fbgemm's jagged operators cannot be loaded back anyway: `dense_to_jagged`
        returns `(Tensor, Tensor[])`, and torch.export's deserializer names the list's `getitem`
        node itself, a name a later node of the saved graph can hold ("Node redefined name
        getitem_N", torch 2.13)."""
        n = self.max_len
        lengths = valid.sum(dim=1)
        pos = torch.arange(n, device=x.device)
        index = (pos[None] - (n - lengths)[:, None]).clamp(min=0)  # each item's place, oldest at 0
        tokens = self.dropout(x * self.scale + self.position.weight[index])
        mask = (valid[:, :, None] & valid[:, None, :] & (pos[:, None] >= pos[None, :])).float()
        buckets = self.biases[0].bucketize(timestamps[:, :n], timestamps[:, 1:]) if self.biases is not None else None
        for i, layer in enumerate(self.layers):
            bias = None if buckets is None or self.biases is None else self.biases[i].from_buckets(buckets)
            tokens = layer.forward_padded(tokens, mask, bias)
        norm = torch.linalg.vector_norm(tokens, dim=-1, keepdim=True).clamp(min=OUTPUT_NORM_EPS)
        return torch.where(valid[..., None], tokens / norm, 0.0)

    def forward(self, x: torch.Tensor, timestamps: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        offsets, mask = self.geometry(valid)
        tokens = self.embed(x, valid)
        tokens = self.run_layers(tokens, offsets, mask, self.time_buckets(timestamps, valid, offsets))
        return self.finish(tokens, valid)
