"""SASRec (Kang & McAuley, "Self-Attentive Sequential Recommendation", ICDM 2018) for next-item
retrieval: `model=sasrec`.

The encoder is the paper's, as in its PyTorch reimplementation (pmixer/SASRec.pytorch): item
embeddings scaled by sqrt(d) plus learned absolute position embeddings (sequences left-padded
to `max_seq_len`, padding rows zero), dropout, then `num_blocks` blocks of

    q = LayerNorm(x);  x = q + CausalMultiHeadAttention(q, x, x)
    x = LayerNorm(x);  x = x + Dropout(W2 Dropout(ReLU(W1 Dropout(x))))

and a final LayerNorm. Padded positions are zero at the first block's input only: as in the
reference implementation, the causal mask is the only mask (padded positions are neither zeroed
between blocks nor hidden as keys; the loss and the scores read real positions only).
With `model.norm_first` the blocks are pre-LN instead (the reference
implementation's `norm_first` option, which it measures as better on every data set but one):

    x = x + CausalMultiHeadAttention(LayerNorm(x));  x = x + FeedForward(LayerNorm(x))

Item table, losses and evaluation are `recsys_pipe.models.retrieval`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recsys_pipe.data.batch import DataSpec
from recsys_pipe.models.dropout import Dropout
from recsys_pipe.models.retrieval import RetrievalModel
from recsys_pipe.models.retrieval_config import SASRecConfig

__all__ = ["SASRecBlock", "SASRecConfig", "SASRecEncoder", "build_sasrec"]

#: LayerNorm epsilon of the reference implementation
LAYER_NORM_EPS = 1e-8


def build_sasrec(cfg: SASRecConfig, spec: DataSpec) -> RetrievalModel:
    """Builder of `model.name=sasrec`."""
    return RetrievalModel(cfg, spec, SASRecEncoder)


class SASRecBlock(nn.Module):
    """One self-attention block: the paper's code's layout (normalised query, post-LN point-wise
    feed-forward) or, with `norm_first`, a pre-LN block.

    Every dropout site, the attention weights' included, is a `Dropout` module (masks from the
    model's `DropoutRng`): `nn.MultiheadAttention` is built without dropout, and a training
    forward with attention dropout computes the attention itself (`_attend_with_dropout`)."""

    def __init__(self, dim: int, heads: int, dropout: float, norm_first: bool = False) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.attention_norm = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.attention_dropout = Dropout(dropout)
        self.forward_norm = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.feed_forward = nn.Sequential(
            nn.Linear(dim, dim), Dropout(dropout), nn.ReLU(), nn.Linear(dim, dim), Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        if self.norm_first:
            q = self.attention_norm(x)
            x = x + self._attend(q, q, causal)
            return x + self.feed_forward(self.forward_norm(x))
        q = self.attention_norm(x)
        x = self.forward_norm(q + self._attend(q, x, causal))
        return x + self.feed_forward(x)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        if self.training and self.attention_dropout.p > 0:
            return self._attend_with_dropout(q, kv, causal)
        return self.attention(q, kv, kv, attn_mask=causal, need_weights=False)[0]

    def _attend_with_dropout(self, q: torch.Tensor, kv: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        """`nn.MultiheadAttention`'s computation (its weights) with dropout on the attention
        weights from `attention_dropout`. Written out because torch's attention kernels draw
        their dropout from the global generator and take no other."""
        mha = self.attention
        d, h = mha.embed_dim, mha.num_heads
        w, b = mha.in_proj_weight.chunk(3), mha.in_proj_bias.chunk(3)
        heads = [F.linear(t, w[i], b[i]).unflatten(-1, (h, d // h)).transpose(1, 2) for i, t in enumerate((q, kv, kv))]
        query, key, value = heads  # [B, h, N, d / h]
        scores = (query @ key.transpose(-2, -1)) * (d // h) ** -0.5
        weights = self.attention_dropout(scores.masked_fill(causal, float("-inf")).softmax(dim=-1))
        return mha.out_proj((weights @ value).transpose(1, 2).flatten(2))


class SASRecEncoder(nn.Module):
    """Left-padded item embeddings `[B, N, D]` -> one vector per position `[B, N, D]`."""

    def __init__(self, cfg: SASRecConfig) -> None:
        super().__init__()
        n, d = cfg.max_seq_len, cfg.embedding_dim
        self.scale = d**0.5
        self.position = nn.Embedding(n + 1, d, padding_idx=0)  # 0: padding
        self.dropout = Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            SASRecBlock(d, cfg.num_heads, cfg.dropout, cfg.norm_first) for _ in range(cfg.num_blocks)
        )
        self.final_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.register_buffer("causal", ~torch.ones(n, n, dtype=torch.bool).tril(), persistent=False)
        for p in self.parameters():  # the reference code's initialisation: Xavier-normal wherever it applies
            if p.dim() > 1:
                nn.init.xavier_normal_(p)
        with torch.no_grad():
            self.position.weight[0].zero_()

    def embed(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The first block's input: items scaled by sqrt(d) plus positions, dropout, padded
        positions zero (the only place padding is masked, as in the reference code)."""
        positions = torch.arange(1, x.shape[1] + 1, device=x.device)[None, :] * valid
        return self.dropout(x * self.scale + self.position(positions)) * valid[..., None].to(x.dtype)

    def forward(self, x: torch.Tensor, timestamps: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = self.embed(x, valid)
        for block in self.blocks:
            x = block(x, self.causal)
        return self.final_norm(x)
