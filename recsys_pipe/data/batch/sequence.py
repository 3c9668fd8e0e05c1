"""The sequence batch of HSTU ranking: user sequences of items and actions, the last ones the
ranking candidates (`SequenceBatch`, collated from `Sample`s by `collate`), and its feature keys."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from recsys_pipe.data.batch.protocol import TensorBatch, jagged_select, kjt_concat, kjt_select

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["ACTION_KEY", "ITEM_KEY", "MASKED_ACTION", "USER_KEY", "Sample", "SequenceBatch", "collate"]

ITEM_KEY = "item"
ACTION_KEY = "action"
USER_KEY = "user"
MASKED_ACTION = 0
"""Action id fed for candidate tokens: their real action is the label, so it must stay hidden."""


@dataclass
class Sample:
    """One user sequence before collation (plain Python, cheap to build in a worker).

    `items`/`timestamps` cover history followed by `len(labels)` candidates;
    `history_actions` covers only the history (candidate actions are what is predicted).
    """

    sample_id: int
    user: int
    items: list[int]
    timestamps: list[int]
    history_actions: list[int]
    labels: list[list[float]]


@dataclass
class SequenceBatch(TensorBatch):
    """A collated batch of user sequences.

    Attributes:
        sparse_features: KJT with keys `item`, `action` (same lengths: one token per
            interaction, candidates last with action `MASKED_ACTION`) and, optionally,
            `user` (one contextual id per sample).
        timestamps: `[num_item_tokens]` int64, aligned with the `item` values.
        num_candidates: `[B]` int64, how many trailing item tokens of each sample are
            ranking candidates.
        labels: `[sum(num_candidates), num_tasks]` float32, one row per candidate.
        sample_ids: `[B]` int64, globally unique ids (identity checks across pipelines).
    """

    sparse_features: KeyedJaggedTensor
    timestamps: torch.Tensor
    num_candidates: torch.Tensor
    labels: torch.Tensor
    sample_ids: torch.Tensor

    def num_loss_tokens(self) -> torch.Tensor:
        """The candidates (what the loss averages over), as a 1-element tensor on the batch's
        device: computed there, so reading it never waits for the device."""
        return self.num_candidates.sum().reshape(1)

    def item_lengths(self) -> torch.Tensor:
        """`[B]` item tokens (history + candidates) of each sample."""
        kjt = self.sparse_features
        return kjt.lengths().view(len(kjt.keys()), kjt.stride())[kjt.keys().index(ITEM_KEY)]

    def sequence_lengths(self) -> torch.Tensor:
        """`[B]` tokens the model attends over per sample: items plus the user token, if any."""
        lengths = self.item_lengths().long()
        keys = self.sparse_features.keys()  # a list: a KJT itself has no `in`
        return lengths + 1 if USER_KEY in keys else lengths

    def select(self, index: torch.Tensor) -> SequenceBatch:
        """The sequences at `index` (a `[k]` int64 tensor of positions), as a new batch (for the batch shuffler)."""
        return SequenceBatch(
            sparse_features=kjt_select(self.sparse_features, index),
            timestamps=jagged_select(self.timestamps, self.item_lengths(), index)[0],
            num_candidates=self.num_candidates[index],
            labels=jagged_select(self.labels, self.num_candidates, index)[0],
            sample_ids=self.sample_ids[index],
        )

    @classmethod
    def concat(cls, batches: Sequence[SequenceBatch]) -> SequenceBatch:
        """The sequences of `batches`, in order, as one batch (for the batch shuffler)."""
        return SequenceBatch(
            sparse_features=kjt_concat([b.sparse_features for b in batches]),
            timestamps=torch.cat([b.timestamps for b in batches]),
            num_candidates=torch.cat([b.num_candidates for b in batches]),
            labels=torch.cat([b.labels for b in batches]),
            sample_ids=torch.cat([b.sample_ids for b in batches]),
        )


def collate(samples: Sequence[Sample], use_user_feature: bool = False) -> SequenceBatch:
    """Collate samples into a `SequenceBatch`.

    Args:
        samples: the batch's samples, each with at least one candidate.
        use_user_feature: also give the batch the `user` feature (one id per sample).

    Returns:
        The batch: its KJT of items and actions (candidates last), timestamps, labels and ids."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = [len(s.items) for s in samples]
    items = [i for s in samples for i in s.items]
    actions = [a for s in samples for a in s.history_actions + [MASKED_ACTION] * len(s.labels)]
    keys = [ITEM_KEY, ACTION_KEY]
    values = items + actions
    all_lengths = lengths + lengths
    if use_user_feature:
        keys.append(USER_KEY)
        values += [s.user for s in samples]
        all_lengths += [1] * len(samples)
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(all_lengths, dtype=torch.int32),
    )
    return SequenceBatch(
        sparse_features=kjt,
        timestamps=torch.tensor([t for s in samples for t in s.timestamps], dtype=torch.int64),
        num_candidates=torch.tensor([len(s.labels) for s in samples], dtype=torch.int64),
        labels=torch.tensor([row for s in samples for row in s.labels], dtype=torch.float32),
        sample_ids=torch.tensor([s.sample_id for s in samples], dtype=torch.int64),
    )
