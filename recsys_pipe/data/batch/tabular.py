"""The tabular batches of the DLRM family: rows of dense features, sparse features and labels,
from the sources whose config derives from `TabularDataConfig` (`recsys_pipe.data.source`).

Batches are `CriteoBatch` (every sparse feature one id per row: `sparse_ids [B, F]`, with the
KJT built from it) or `TabularBatch` (some feature holds a list of ids per row, multi-hot: a
KJT only, which torchrec's `EmbeddingBagCollection` pools; `dlrm_torch`'s plain tables take one
id per row and refuse it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch

from recsys_pipe.data.batch.protocol import TensorBatch, kjt_concat, kjt_select
from recsys_pipe.data.text.criteo_tsv import CATEGORICAL_KEYS

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["CriteoBatch", "CriteoSample", "TabularBatch", "collate_criteo"]


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


CriteoSample = tuple[np.ndarray, np.ndarray, float, int]
"""(dense features [13] float32, hashed categorical ids [26] int64, label, sample id)."""


@dataclass
class CriteoBatch(TensorBatch):
    """A collated batch of Criteo rows.

    Attributes:
        dense_features: `[B, 13]` float32, transformed integer features.
        sparse_ids: `[B, 26]` int64, hashed categorical ids (one per feature: Criteo's categorical
            features are single-valued).
        labels: `[B, 1]` float32 clicks.
        sample_ids: `[B]` int64, globally unique row ids.
        keys: the KJT key of each column of `sparse_ids`.
    """

    dense_features: torch.Tensor
    sparse_ids: torch.Tensor
    labels: torch.Tensor
    sample_ids: torch.Tensor
    keys: tuple[str, ...] = CATEGORICAL_KEYS

    @cached_property
    def sparse_features(self) -> KeyedJaggedTensor:
        """The ids as a torchrec KJT (key-major, one id per sample and key), built on first use on
        the batch's device; models with torchrec tables read it, plain torch models read
        `sparse_ids`."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        ids = self.sparse_ids
        return KeyedJaggedTensor(
            keys=list(self.keys),
            values=ids.t().reshape(-1),
            lengths=torch.ones(ids.numel(), dtype=torch.int32, device=ids.device),
        )

    def num_loss_tokens(self) -> torch.Tensor:
        """One loss term per sample."""
        return torch.full((1,), self.sample_ids.numel(), dtype=torch.int64, device=self.sample_ids.device)

    def select(self, index: torch.Tensor) -> CriteoBatch:
        """The rows at `index` (a `[k]` int64 tensor of positions), as a new batch (for the batch shuffler)."""
        index = index.to(self.sample_ids.device)
        return CriteoBatch(
            self.dense_features[index], self.sparse_ids[index], self.labels[index], self.sample_ids[index], self.keys
        )

    @classmethod
    def concat(cls, batches: Sequence[CriteoBatch]) -> CriteoBatch:
        """The rows of `batches`, in order, as one batch (for the batch shuffler)."""
        return CriteoBatch(
            torch.cat([b.dense_features for b in batches]),
            torch.cat([b.sparse_ids for b in batches]),
            torch.cat([b.labels for b in batches]),
            torch.cat([b.sample_ids for b in batches]),
            batches[0].keys,
        )


def collate_criteo(samples: Sequence[CriteoSample]) -> CriteoBatch:
    """Stack samples into a `CriteoBatch`."""
    dense, ids, labels, sample_ids = zip(*samples)
    return CriteoBatch(
        dense_features=torch.from_numpy(np.stack(dense)),
        sparse_ids=torch.from_numpy(np.stack(ids)),
        labels=torch.tensor(labels, dtype=torch.float32).reshape(-1, 1),
        sample_ids=torch.tensor(sample_ids, dtype=torch.int64),
    )
