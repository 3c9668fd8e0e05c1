"""What a trained model exports for serving (`recsys-export`): a module of plain tensors in and
scores out, which `torch.export` can trace into a program that loads without this package.

The training forward reads a batch object (torchrec `KeyedJaggedTensor`s, the model protocol of
`recsys_pipe.models.base`) and returns a loss; a serving system sends tensors and wants scores.
So each exportable model says how to score from tensors (`Servable.serving`):

* a ranking model: `scores = program(*inputs)`, logits: `[B, num_tasks]` (DLRM), or
  `[B, max_seq_len, num_tasks]` per candidate (HSTU ranking);
* a retrieval model: `user = program(*inputs)`, `[B, D]`, and the item vectors as a table;
  an item's score is `user @ item_table[item]` (the dot product training ranks by).

`ServingForm.inputs(batch)` turns a batch of the model's data source into the program's inputs
(the example inputs written next to the program), and `ServingForm.reference(batch, outputs)`
picks the training forward's own scores from its outputs, in the program's layout, so an export
can be checked against the model it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from recsys_pipe.data.source import DataConfig

__all__ = ["Servable", "ServingForm"]


@dataclass
class ServingForm:
    """A model's serving program before export.

    Attributes:
        module: `forward(*inputs)` of tensors only: the logits `[B, T]` of a ranking model, the
            user vectors `[B, D]` of a retrieval model.
        input_names: a name for each input, in order (the docs and the example file use them).
        inputs: the program's inputs for a batch of the model's data source.
        reference: the training forward's scores for that batch, from its `outputs`, in the
            layout the program's scores take: `[B, T]` for ranking; for retrieval `[B, C]`, the
            scores of the candidates `candidates(batch)` names.
        item_table: retrieval only: `[num_items, D]`, the vectors the user vectors score.
        candidates: retrieval only: the `[B, C]` item ids `reference` scores, per user.
        dynamic_batch: whether the program accepts any batch size (dimension 0 of every input).
        output: what the program returns, for `serving.json` (default: by the kind of model).
        ragged: inputs whose last dimension is any size too (padded lists), by name.
        program: how raw rows become the inputs (`recsys_pipe.data.preprocess.PROGRAMS`).
        slots: per input, the data's features in its columns, in order (inputs it does not name
            take the data source's own order, e.g. its dense columns).
        params: the program's sizes for `features.json` (`max_seq_len`: its padded length).
        item_remap: retrieval with a managed item table (`ids: managed`): raw item ids to the
            rows of `item_table`; the export then scores the catalogue (`over_catalogue`).
    """

    module: nn.Module
    input_names: tuple[str, ...]
    inputs: Callable[[Any], tuple[torch.Tensor, ...]]
    reference: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]
    item_table: torch.Tensor | None = None
    candidates: Callable[[Any], torch.Tensor] | None = None
    dynamic_batch: bool = True
    output: str | None = None
    ragged: tuple[str, ...] = ()
    program: str = "tabular"
    slots: dict[str, tuple[str, ...]] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    item_remap: nn.Module | None = None

    def over_catalogue(self, catalogue: torch.Tensor) -> ServingForm:
        """A managed item table's form (`item_remap`) over the data's catalogue of raw item ids:
        `item_table[k]` is catalogue item `k`'s vector (its row's, as evaluation scores it: items
        without a row of their own share one), and `candidates` are places in the catalogue."""
        if self.item_remap is None or self.item_table is None or self.candidates is None:
            return self
        table, candidates = self.item_table[self.item_remap(catalogue)], self.candidates
        order = torch.argsort(catalogue)

        def places(batch: Any) -> torch.Tensor:
            raw = candidates(batch)
            return order[torch.searchsorted(catalogue[order], raw).clamp(max=catalogue.numel() - 1)]

        return replace(self, item_table=table, candidates=places, item_remap=None)

    @property
    def retrieval(self) -> bool:
        """Whether the program encodes users (scores come from the item table)."""
        return self.item_table is not None


@runtime_checkable
class Servable(Protocol):
    """A model module that can be exported for serving (every shipped model)."""

    def serving(self, data: DataConfig) -> ServingForm:
        """The model's serving program for batches of `data`, sharing this module's (trained)
        weights."""
        ...
