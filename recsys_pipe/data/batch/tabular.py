"""Tabular sources: rows of dense features, sparse features and labels, for the DLRM family.

`TabularDataConfig` is the base config of every source whose batches the shipped DLRM models
(`model=dlrm`, `dlrm_dcn`, `dlrm_torch`) read: `data=criteo`, `criteo_synthetic`, `parquet`, or a
user's own (`data.builder=my_pkg.data:build` with a config class derived from it). The models
size themselves from the source's `DataSpec`, so any number of dense and sparse features works:
`num_dense` dense floats, one embedding table per entry of `vocab_sizes`, `num_tasks` labels.

Batches are `CriteoBatch` (every sparse feature one id per row: `sparse_ids [B, F]`, with the
KJT built from it) or `TabularBatch` (some feature holds a list of ids per row, multi-hot: a
KJT only, which torchrec's `EmbeddingBagCollection` pools; `dlrm_torch`'s plain tables take one
id per row and refuse it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from recsys_pipe.data.batch.protocol import TensorBatch, kjt_concat, kjt_select
from recsys_pipe.data.source import DataConfig

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["TabularBatch", "TabularDataConfig"]


class TabularDataConfig(DataConfig):
    """Base of the sources of tabular rows that the DLRM models train on.

    A subclass's builder returns batches with `dense_features [B, num_dense]` float32,
    `sparse_features` (a KJT with one key per feature of `spec().vocab_sizes`), `labels
    [B, num_tasks]` float32 and `sample_ids [B]`; `spec()` (by default read from a one-rank
    dataset) sizes the model. `multi_hot_features()` names the features with more than one id
    per row (only torchrec's pooled tables take them).
    """

    def multi_hot_features(self) -> list[str]:
        """The sparse features that hold a list of ids per row (none by default)."""
        return []


@dataclass
class TabularBatch(TensorBatch):
    """A batch of tabular rows whose sparse features may be multi-hot (jagged).

    Attributes:
        dense_features: `[B, num_dense]` float32.
        sparse_features: KJT, one key per sparse feature, `B` lengths each.
        labels: `[B, num_tasks]` float32.
        sample_ids: `[B]` int64, the rows' global positions.
    """

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor
    sample_ids: torch.Tensor

    def num_loss_tokens(self) -> torch.Tensor:
        """One loss term per row."""
        return torch.full((1,), self.sample_ids.numel(), dtype=torch.int64, device=self.sample_ids.device)

    def select(self, index: torch.Tensor) -> TabularBatch:
        """The rows at `index`, as a new batch (for the batch shuffler)."""
        index = index.to(self.sample_ids.device)
        return TabularBatch(
            self.dense_features[index],
            kjt_select(self.sparse_features, index),
            self.labels[index],
            self.sample_ids[index],
        )

    @classmethod
    def concat(cls, batches: Sequence[TabularBatch]) -> TabularBatch:
        """The rows of `batches`, in order, as one batch (for the batch shuffler)."""
        return TabularBatch(
            torch.cat([b.dense_features for b in batches]),
            kjt_concat([b.sparse_features for b in batches]),
            torch.cat([b.labels for b in batches]),
            torch.cat([b.sample_ids for b in batches]),
        )
