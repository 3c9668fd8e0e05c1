"""The HSTU ranking model (`model=hstu_small`, the main job's) cut into pipeline stages (the
`stage_split` its config declares, `HSTUConfig.stage_split`).

`hstu_stages(model, split)` cuts an `HSTUModel` into stage modules that share its parameters:
the first stage holds the embedding collection, the token assembly (items + actions, the user's
context tokens), the relative time bias and the first layers; the middle stages hold layers;
the last stage holds the last layers, the final norm, the multi-task head and the loss. Between
stages travel the jagged tokens `[T, D]` and the relative bias `[B, N, N]` (its gradient flows
back to the first stage's bias parameters like any activation's); the token offsets and the
attention mask depend only on the batch's lengths, so every stage computes them from its copy
of the microbatch instead of receiving them.

The stages run the model's own modules and helpers in the model's order, so the stages chained
on one rank compute the model's loss and gradients bitwise (a test checks it). Dropout must not
depend on placement: each cut keys the model's dropout sites (`Dropout` modules, the attention
weights' included) by (step, microbatch, site) (`MICROBATCH_DROPOUT.attach`, sites numbered in
the whole model's module order), so a pipelined run draws the masks of the one-rank run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
from torch import nn

from recsys_pipe.data.batch import ACTION_KEY, ITEM_KEY, USER_KEY
from recsys_pipe.models.dropout import MICROBATCH_DROPOUT
from recsys_pipe.models.hstu import HSTUModel, attention_mask, candidate_rows, prepend_context

__all__ = ["HSTUStage", "hstu_stages"]


class HSTUStage(nn.Module):
    """Layers `layers` of an `HSTUModel`; see the module docstring for what each end adds."""

    #: none: the ranking metrics are summed over the ranks, so only the last stage's count
    shared_eval_outputs: tuple[str, ...] = ()

    def __init__(self, model: HSTUModel, layers: Sequence[int], first: bool, last: bool):
        super().__init__()
        ranker = model.ranker
        self.first, self.last = first, last
        self.padded_len, self.with_user = ranker.padded_len, ranker.with_user
        self.layers = nn.ModuleList(ranker.layers[i] for i in layers)
        if first:
            self.ec = model.ec
            self.input_dropout = ranker.input_dropout
            self.bias = ranker.bias
        if last:
            self.final_norm = ranker.final_norm
            self.head = ranker.head

    def _geometry(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens per sample (items, plus the user's context tokens), their offsets and the
        attention mask, from the batch's lengths alone (as HSTURanker computes them)."""
        kjt = batch.sparse_features
        lengths = kjt[ITEM_KEY].lengths().long()
        if self.with_user:
            lengths = kjt[USER_KEY].lengths().long() + lengths
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        return lengths, offsets, attention_mask(lengths, batch.num_candidates, self.padded_len)

    def _embed(self, batch: Any, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """HSTURanker's token assembly: the tokens, and the relative bias if the model has one."""
        embeddings = self.ec(batch.sparse_features)
        items, actions = embeddings[ITEM_KEY], embeddings[ACTION_KEY]
        tokens, timestamps = items.values() + actions.values(), batch.timestamps
        if self.with_user:
            tokens, timestamps, _ = prepend_context(tokens, timestamps, items.lengths().long(), embeddings[USER_KEY])
        if self.bias is None:
            return (self.input_dropout(tokens),)
        padded_ts = torch.ops.fbgemm.jagged_1d_to_dense(timestamps, offsets, self.padded_len, 0)
        return self.input_dropout(tokens), self.bias(padded_ts)

    def forward(self, batch: Any, inputs: tuple[torch.Tensor, ...]) -> Any:
        _, offsets, mask = self._geometry(batch)
        x, *bias = self._embed(batch, offsets) if self.first else inputs
        for layer in self.layers:
            x = layer(x, offsets, mask, bias[0] if bias else None)
        if not self.last:
            return (x, *bias)
        labels = batch.labels
        rows = candidate_rows(offsets, batch.num_candidates, labels.shape[0])
        logits = self.head(self.final_norm(x)[rows])
        per_token = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        #: what evaluation reads besides the loss (the model's `logits` and `labels` outputs)
        self.last_outputs = {"logits": logits.detach(), "labels": labels}
        return per_token.mean(dim=0).sum()


def hstu_stages(model: HSTUModel, split: Sequence[Sequence[int]]) -> list[HSTUStage]:
    """`model` cut into stages holding the layers `split[s]` (consecutive, covering all). Its
    dropout sites are keyed (`MICROBATCH_DROPOUT`: the model itself then needs `microbatch_seed`
    to train with dropout, as the stage runtime provides)."""
    flat = [i for layers in split for i in layers]
    if flat != list(range(len(model.ranker.layers))):
        raise ValueError(f"the stages must hold layers 0..{len(model.ranker.layers) - 1} in order, got {split}")
    MICROBATCH_DROPOUT.attach(model)
    return [HSTUStage(model, layers, s == 0, s == len(split) - 1) for s, layers in enumerate(split)]
