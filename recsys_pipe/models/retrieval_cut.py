"""The retrieval models cut into pipeline stages: SASRec (`model=sasrec`) and HSTU retrieval
(`model=hstu_retrieval`), the `stage_split` their configs declare.

`sasrec_stages(model, split)` cuts a SASRec `RetrievalModel` likewise: the item table lookup,
left padding, the scaled input plus position embeddings and the first blocks on the first
stage; the last blocks, the final norm and the loss on the last. The table is tied: the loss
scores the positions against the embeddings of their target and negative items, which the first
stage looked up, so those rows travel with the activations and their gradients come back to the
table. The padding mask comes from the batch's lengths on every stage.

`hstu_retrieval_stages(model, split)` cuts an HSTU retrieval `RetrievalModel` the same way as
SASRec at its ends (lookup, scaled items plus positions first; the output normalisation and loss
last), with HSTU's jagged tokens `[T, D]` travelling between stages. Each block has its own
relative bias, which its stage computes from its copy of the microbatch's timestamps.

The stages run the model's own modules and helpers in the model's order, so the stages chained
on one rank compute the model's loss and gradients bitwise (a test checks it). Dropout must not
depend on placement: each cut keys the model's dropout sites (`Dropout` modules, the attention
weights' included) by (step, microbatch, site) (`MICROBATCH_DROPOUT.attach`, sites numbered in
the whole model's module order), so a pipelined run draws the masks of the one-rank run.

In evaluation mode the retrieval stages carry, instead of the loss's target and negative rows,
the rows the evaluation ranks against: the held-out item and its sampled negatives, and the whole
catalogue with `data.full_eval` (the first stage looks them up in its sharded table). The last
stage ranks them as `RetrievalHead` does and keeps the ranks (`last_outputs`), which the
pipeline then hands to every one of its ranks (`shared_eval_outputs`).

"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
from torch import nn

from recsys_pipe.data.batch import CAND_KEY, CATALOG_KEY, INPUT_KEY, NEG_KEY, POS_KEY
from recsys_pipe.models.dropout import MICROBATCH_DROPOUT
from recsys_pipe.models.retrieval import RetrievalModel, left_pad, padded_times

__all__ = ["HSTURetrievalStage", "SASRecStage", "hstu_retrieval_stages", "sasrec_stages"]


#: what a retrieval pipeline's evaluation hands from its last stage to every one of its ranks
_RETRIEVAL_EVAL_OUTPUTS = ("rank_sampled", "rank_full")


def _target_rows(rows: dict[str, torch.Tensor], training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The item rows a retrieval model's last stage scores, looked up on the first: in training
    the target and negative items of the loss; in evaluation the held-out items with their
    sampled negatives and the catalogue (empty without `data.full_eval`), which it ranks."""
    return (rows[POS_KEY], rows[NEG_KEY]) if training else (rows[CAND_KEY], rows[CATALOG_KEY])


def _score_targets(stage: Any, h: torch.Tensor, valid: torch.Tensor, targets: Sequence[torch.Tensor], batch: Any):
    """A retrieval model's last stage on the encoded sequences `h` `[B, N, D]`: the loss in
    training; in evaluation `RetrievalHead`'s ranks, kept in `stage.last_outputs`, and a zero loss."""
    first, second = targets
    if stage.training:
        loss, _ = stage._loss(h, valid, {POS_KEY: first, NEG_KEY: second}, batch.sparse_features, batch.neg_index)
        return loss
    loss, stage.last_outputs = stage._rank(h, {CAND_KEY: first, CATALOG_KEY: second}, batch.sparse_features)
    return loss


class SASRecStage(nn.Module):
    """Blocks `blocks` of a SASRec `RetrievalModel`; see the module docstring for each end."""

    #: the evaluation outputs every rank of the pipeline receives (`PipelinedModel`)
    shared_eval_outputs = _RETRIEVAL_EVAL_OUTPUTS

    def __init__(self, model: RetrievalModel, blocks: Sequence[int], first: bool, last: bool):
        super().__init__()
        head, encoder = model.head, model.head.encoder
        self.first, self.last = first, last
        self.max_len, self.dim = head.max_len, head.dim
        self.blocks = nn.ModuleList(encoder.blocks[i] for i in blocks)
        self.register_buffer("causal", encoder.causal, persistent=False)
        if first:
            self.ec, self.position, self.dropout = model.ec, encoder.position, encoder.dropout
            self._embed_items = encoder.embed  # bound: its modules are the stage's, registered above
        if last:
            self.final_norm = encoder.final_norm
            # the head's loss and ranks as bound methods, not a submodule: the head's only
            # parameters are the encoder's, which belong to the stages holding them
            self._loss, self._rank = head._train_loss, head._rank

    def _valid(self, batch: Any) -> torch.Tensor:
        """The `[B, N]` mask of real (left-padded) positions, from the batch's lengths."""
        lengths = batch.lengths(INPUT_KEY).long()
        return left_pad(torch.empty(int(lengths.sum()), 0), lengths, self.max_len)[1]

    def _embed(self, batch: Any, valid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """RetrievalHead's lookup and SASRecEncoder's input: the scaled items plus positions, and
        the rows the last stage scores (`_target_rows`)."""
        embeddings = self.ec(batch.sparse_features)
        lengths = embeddings[INPUT_KEY].lengths().long()
        rows = {key: jt.values()[:, : self.dim] for key, jt in embeddings.items()}
        x, _ = left_pad(rows[INPUT_KEY], lengths, self.max_len)
        return self._embed_items(x, valid), *_target_rows(rows, self.training)

    def forward(self, batch: Any, inputs: tuple[torch.Tensor, ...]) -> Any:
        valid = self._valid(batch)
        x, *targets = self._embed(batch, valid) if self.first else inputs
        for block in self.blocks:
            x = block(x, self.causal)
        if not self.last:
            return x, *targets
        return _score_targets(self, self.final_norm(x), valid, targets, batch)


def sasrec_stages(model: RetrievalModel, split: Sequence[Sequence[int]]) -> list[SASRecStage]:
    """A SASRec `model` cut into stages holding the blocks `split[s]` (consecutive, covering
    all); its dropout sites are keyed (`MICROBATCH_DROPOUT`)."""
    blocks = model.head.encoder.blocks
    if [i for part in split for i in part] != list(range(len(blocks))):
        raise ValueError(f"the stages must hold blocks 0..{len(blocks) - 1} in order, got {split}")
    MICROBATCH_DROPOUT.attach(model)
    return [SASRecStage(model, part, s == 0, s == len(split) - 1) for s, part in enumerate(split)]


class HSTURetrievalStage(nn.Module):
    """Layers `layers` of an HSTU retrieval `RetrievalModel` (with their relative biases); see
    the module docstring. The encoder's own steps (`HSTURetrievalEncoder.geometry`, `embed`,
    `time_buckets`, `run_layers`, `finish`) do the work."""

    #: the evaluation outputs every rank of the pipeline receives (`PipelinedModel`)
    shared_eval_outputs = _RETRIEVAL_EVAL_OUTPUTS

    def __init__(self, model: RetrievalModel, layers: Sequence[int], first: bool, last: bool):
        super().__init__()
        head, encoder = model.head, model.head.encoder
        self.first, self.last = first, last
        self.max_len, self.dim = head.max_len, head.dim
        self.layer_range = range(layers[0], layers[-1] + 1)
        self.layers = nn.ModuleList(encoder.layers[i] for i in layers)
        if encoder.biases is not None:
            self.biases = nn.ModuleList(encoder.biases[i] for i in layers)
        # the encoder's steps, bound; the parameters they use are this stage's (registered above)
        self._encoder = encoder.geometry, encoder.time_buckets, encoder.run_layers, encoder.finish
        if first:
            self.ec, self.position, self.dropout = model.ec, encoder.position, encoder.dropout
            self._encoder_embed = encoder.embed
        if last:
            self._loss, self._rank = head._train_loss, head._rank  # bound: the parameters are the stages'

    def forward(self, batch: Any, inputs: tuple[torch.Tensor, ...]) -> Any:
        geometry, time_buckets, run_layers, finish = self._encoder
        lengths = batch.lengths(INPUT_KEY).long()
        valid = left_pad(torch.empty(int(lengths.sum()), 0), lengths, self.max_len)[1]
        offsets, mask = geometry(valid)
        if self.first:  # `RetrievalHead`'s lookup, and the rows the last stage scores
            embeddings = self.ec(batch.sparse_features)
            rows = {key: jt.values()[:, : self.dim] for key, jt in embeddings.items()}
            x, _ = left_pad(rows[INPUT_KEY], embeddings[INPUT_KEY].lengths().long(), self.max_len)
            tokens, (first_rows, second_rows) = self._encoder_embed(x, valid), _target_rows(rows, self.training)
        else:
            tokens, first_rows, second_rows = inputs
        times = padded_times(batch.timestamps, batch.target_timestamps, lengths, self.max_len)
        tokens = run_layers(tokens, offsets, mask, time_buckets(times, valid, offsets), self.layer_range)
        if not self.last:
            return tokens, first_rows, second_rows
        return _score_targets(self, finish(tokens, valid), valid, (first_rows, second_rows), batch)


def hstu_retrieval_stages(model: RetrievalModel, split: Sequence[Sequence[int]]) -> list[HSTURetrievalStage]:
    """An HSTU retrieval `model` cut into stages holding the layers `split[s]` (consecutive,
    covering all); its dropout sites are keyed (`MICROBATCH_DROPOUT`)."""
    encoder = model.head.encoder
    if [i for part in split for i in part] != list(range(len(encoder.layers))):
        raise ValueError(f"the stages must hold layers 0..{len(encoder.layers) - 1} in order, got {split}")
    MICROBATCH_DROPOUT.attach(model)
    return [HSTURetrievalStage(model, part, s == 0, s == len(split) - 1) for s, part in enumerate(split)]
