"""What a data source tells the model: feature vocabularies, dense width and label layout."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from recsys_pipe.data.ids import ManagedFeature

__all__ = ["DataSpec"]


@dataclass(frozen=True)
class DataSpec:
    """Sizes a model needs to match a data source.

    Attributes:
        num_tasks: binary labels per scored row (the width of `outputs["labels"]`).
        vocab_sizes: sparse feature (the batch's KJT key) -> its vocabulary size; ids are in
            `[0, size)`. Only features the batches carry are listed.
        num_dense: dense (float) features per sample; 0 when there are none.
        managed: the features with `ids: managed` (`recsys_pipe.data.ids.ManagedIds`): their
            ids are raw, in `[0, input_hash_size)`, and the model gives them rows with
            managed-collision tables of `vocab_sizes[feature]` rows (`recsys_pipe.models.managed`).
    """

    num_tasks: int
    vocab_sizes: Mapping[str, int]
    num_dense: int = 0
    managed: Mapping[str, ManagedFeature] = field(default_factory=dict)
