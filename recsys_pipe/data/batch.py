"""The training batch: one object that torchrec's pipeline machinery can move and split.

torchrec's sparse-dist pipeline finds the sharded embedding call in the model by FX tracing and
re-reads its input from the batch with the same attribute path (`batch.sparse_features`), so
the KJT has to be a plain attribute of the object handed to `model.forward`. Everything else
the dense part needs rides along as plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

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
class Batch(Pipelineable):
    """A collated batch of sequences.

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

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            sparse_features=self.sparse_features.to(device, non_blocking=non_blocking),
            timestamps=self.timestamps.to(device, non_blocking=non_blocking),
            num_candidates=self.num_candidates.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            sample_ids=self.sample_ids.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.sparse_features.record_stream(stream)
        for t in (self.timestamps, self.num_candidates, self.labels, self.sample_ids):
            t.record_stream(stream)

    def pin_memory(self) -> Batch:
        """Called by the DataLoader (`pin_memory=True`) so `to(non_blocking=True)` is async."""
        return Batch(
            sparse_features=self.sparse_features.pin_memory(),
            timestamps=self.timestamps.pin_memory(),
            num_candidates=self.num_candidates.pin_memory(),
            labels=self.labels.pin_memory(),
            sample_ids=self.sample_ids.pin_memory(),
        )

    @property
    def batch_size(self) -> int:
        return int(self.sample_ids.numel())

    def num_loss_tokens(self) -> torch.Tensor:
        """How many terms the loss averages over (the candidates), as a 1-element tensor on the
        batch's device: computed there, so reading it never waits for the device."""
        return self.num_candidates.sum().reshape(1)


def collate(samples: Sequence[Sample], use_user_feature: bool = False) -> Batch:
    """Collate samples (each with at least one candidate) into a `Batch`."""
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
    return Batch(
        sparse_features=kjt,
        timestamps=torch.tensor([t for s in samples for t in s.timestamps], dtype=torch.int64),
        num_candidates=torch.tensor([len(s.labels) for s in samples], dtype=torch.int64),
        labels=torch.tensor([row for s in samples for row in s.labels], dtype=torch.float32),
        sample_ids=torch.tensor([s.sample_id for s in samples], dtype=torch.int64),
    )
