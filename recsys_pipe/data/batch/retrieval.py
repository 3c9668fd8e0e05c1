"""The next-item retrieval batch (SASRec, HSTU retrieval): `RetrievalSample`s collated into a
`RetrievalBatch` (`collate_retrieval`), and the batch's feature keys.

All item lookups of a batch are features of one KJT, `sparse_features`, that share the item
table: `item` (inputs), `pos` (targets), `neg` (negatives), `cand` (held-out item then sampled
negatives) and `catalog` (every item, evaluation only). Every batch has all five keys (a sharded
module's input distribution is fixed by the first batch's keys); unused ones are empty.
With several negatives per target, `neg` holds the batch's distinct negatives and the batch's
`neg_index` says which are each target's (`RetrievalBatch`): at ML-1M's sizes 1.7 million drawn
ids are a few thousand items, so the item table looks up, and its gradient sums, a few thousand
rows instead of 1.7 million.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from recsys_pipe.data.batch.protocol import TensorBatch, jagged_select, kjt_concat, kjt_select

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "CAND_KEY",
    "CATALOG_KEY",
    "INPUT_KEY",
    "NEG_KEY",
    "POS_KEY",
    "RETRIEVAL_KEYS",
    "RawItemCollate",
    "RetrievalBatch",
    "RetrievalSample",
    "collate_retrieval",
    "distinct_negatives",
    "raw_item_collate",
    "with_raw_items",
]

INPUT_KEY, POS_KEY, NEG_KEY, CAND_KEY, CATALOG_KEY = "item", "pos", "neg", "cand", "catalog"
RETRIEVAL_KEYS = (INPUT_KEY, POS_KEY, NEG_KEY, CAND_KEY, CATALOG_KEY)
"""The features of a retrieval batch's KJT, in order; all look up the one item table."""


@dataclass
class RetrievalSample:
    """One user's sample before collation (dense ids). Training: `inputs`, `targets`, `negatives`
    (`negatives_per_target` per target, target by target; an int64 array: 25,000 of them per
    user at ML-1M's sizes); evaluation: `inputs`, `candidates`
    (held-out item first). `sample_id` is the dense user id, or -1 for padding (evaluation batches
    are padded to the same count on every rank and padding is not scored)."""

    sample_id: int
    inputs: list[int]
    timestamps: list[int]
    targets: list[int]
    negatives: Sequence[int]
    candidates: list[int]
    #: time of the item after the last input (training: the last target; evaluation: the held-out item)
    target_timestamp: int = 0


@dataclass
class RetrievalBatch(TensorBatch):
    """A collated retrieval batch.

    Attributes:
        sparse_features: KJT with the keys of `RETRIEVAL_KEYS` (see the module docstring).
        timestamps: `[num input tokens]` int64, aligned with the `item` values.
        target_timestamps: `[B]` int64, each sample's `RetrievalSample.target_timestamp`.
        sample_ids: `[B]` int64, the dense user ids (-1: evaluation padding).
        neg_index: with several negatives per target (`negatives_per_target > 1`), `[T * k]` int64:
            negative `j` of target `t` is `neg` value `neg_index[t * k + j]`, and `neg` holds the
            batch's distinct negatives, ascending, all in the first sample's slot
            (`distinct_negatives`): the item table looks each up once, however many positions
            score it. Empty when `neg` holds one negative per target, target by target.
    """

    sparse_features: KeyedJaggedTensor
    timestamps: torch.Tensor
    sample_ids: torch.Tensor
    target_timestamps: torch.Tensor
    neg_index: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    def lengths(self, key: str) -> torch.Tensor:
        """`[B]` ids of feature `key` per sample."""
        kjt = self.sparse_features
        return kjt.lengths().view(len(kjt.keys()), kjt.stride())[kjt.keys().index(key)]

    def num_loss_tokens(self) -> torch.Tensor:
        """Target positions (what the loss averages over) as a 1-element tensor on the batch's device."""
        return self.lengths(POS_KEY).long().sum().reshape(1)

    def negatives_per_position(self) -> torch.Tensor:
        """`[T * k]` every target's negatives, target by target (`neg_index` resolved)."""
        kjt = self.sparse_features
        neg = kjt[NEG_KEY].values()
        return neg[self.neg_index] if self.neg_index.numel() else neg

    def _per_position(self) -> KeyedJaggedTensor:
        """The KJT with every target's negatives in its sample's slot (what `select` and `concat`
        cut and join before `with_negatives` makes the batch form again)."""
        if not self.neg_index.numel():
            return self.sparse_features
        k = self.neg_index.numel() // max(1, int(self.lengths(POS_KEY).sum()))
        return _replace_negatives(self.sparse_features, self.negatives_per_position(), self.lengths(POS_KEY) * k)

    def with_negatives(self, negatives: torch.Tensor) -> RetrievalBatch:
        """This batch with the training negatives `negatives` (`[T * k]`, target by target), in the
        batch form: with `k > 1`, the distinct ones and `neg_index` (`distinct_negatives`)."""
        targets = self.lengths(POS_KEY)
        total = int(targets.sum())
        if total and negatives.numel() > total:
            values, index = distinct_negatives(negatives)
            lengths = torch.zeros_like(targets)
            lengths[0] = values.numel()
        else:
            values, index = negatives, torch.zeros(0, dtype=torch.int64, device=negatives.device)
            lengths = targets * (negatives.numel() // max(1, total))
        return dataclasses.replace(
            self, sparse_features=_replace_negatives(self.sparse_features, values, lengths), neg_index=index
        )

    def select(self, index: torch.Tensor) -> RetrievalBatch:
        kjt = self._per_position()
        batch = RetrievalBatch(
            sparse_features=kjt_select(kjt, index),
            timestamps=jagged_select(self.timestamps, self.lengths(INPUT_KEY), index)[0],
            sample_ids=self.sample_ids[index],
            target_timestamps=self.target_timestamps[index],
        )
        return batch.with_negatives(batch.sparse_features[NEG_KEY].values()) if self.neg_index.numel() else batch

    @classmethod
    def concat(cls, batches: Sequence[RetrievalBatch]) -> RetrievalBatch:
        batch = RetrievalBatch(
            sparse_features=kjt_concat([b._per_position() for b in batches]),
            timestamps=torch.cat([b.timestamps for b in batches]),
            sample_ids=torch.cat([b.sample_ids for b in batches]),
            target_timestamps=torch.cat([b.target_timestamps for b in batches]),
        )
        several = any(b.neg_index.numel() for b in batches)
        return batch.with_negatives(batch.sparse_features[NEG_KEY].values()) if several else batch


def distinct_negatives(negatives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(distinct, index)`: the distinct ids of `negatives`, ascending, and each negative's place
    among them (`distinct[index] == negatives`), as `torch.unique(sorted=True, return_inverse=True)`
    gives them, by a bitmap over the ids instead of a sort: per-position negatives are some
    1.7 million ids of a few thousand items per batch at ML-1M's sizes, where the sort took ~10x longer."""
    if not negatives.numel():
        return negatives, torch.zeros(0, dtype=torch.int64, device=negatives.device)
    if int(negatives.max()) >= max(_BITMAP_IDS, 4 * negatives.numel()):  # raw ids (data.ids=managed): a sort
        distinct, place = torch.unique(negatives, sorted=True, return_inverse=True)
        return distinct, place
    present = torch.zeros(int(negatives.max()) + 1, dtype=torch.bool, device=negatives.device)
    present[negatives] = True
    distinct = present.nonzero().squeeze(1)
    place = torch.cumsum(present, 0, dtype=torch.int64) - 1
    return distinct, place[negatives]


#: ids below this many (or 4x the negatives) are made distinct by a bitmap, larger ones by a sort
_BITMAP_IDS = 1 << 24


def with_raw_items(batch: RetrievalBatch, catalogue: torch.Tensor) -> RetrievalBatch:
    """`batch` with every item id (inputs, targets, negatives, candidates, the catalogue) as
    the raw id `catalogue[id]` (`data.ids=managed`: the model's managed item table remaps them),
    in the batch form of `RetrievalBatch.with_negatives` (the distinct raw negatives)."""
    kjt = batch._per_position()
    raw = type(kjt)(keys=kjt.keys(), values=catalogue[kjt.values()], lengths=kjt.lengths())
    several = batch.neg_index.numel() > 0
    batch = dataclasses.replace(batch, sparse_features=raw, neg_index=torch.zeros(0, dtype=torch.int64))
    return batch.with_negatives(raw[NEG_KEY].values()) if several else batch


class RawItemCollate:
    """A retrieval source's collate whose batches carry raw item ids (`with_raw_items`): the
    source samples dense ids (its negatives are drawn by dense id), the model gets raw ones."""

    def __init__(self, collate: Any, catalogue: np.ndarray) -> None:
        self.collate, self.catalogue = collate, torch.from_numpy(np.asarray(catalogue, dtype=np.int64))

    def __call__(self, samples: Sequence[RetrievalSample]) -> RetrievalBatch:
        return with_raw_items(self.collate(samples), self.catalogue)


def raw_item_collate(collate: Any, catalogue: np.ndarray | None) -> Any:
    """`collate`, its batches' item ids made raw ids where the source has a `catalogue` of them
    (`data.ids=managed`: `RawItemCollate`)."""
    return collate if catalogue is None else RawItemCollate(collate, catalogue)


def _replace_negatives(kjt: KeyedJaggedTensor, values: torch.Tensor, lengths: torch.Tensor) -> KeyedJaggedTensor:
    """`kjt` with the `neg` feature's values and per-sample lengths replaced."""
    keys = kjt.keys()
    parts = kjt.to_dict()
    per_key = [(values, lengths) if key == NEG_KEY else (parts[key].values(), parts[key].lengths()) for key in keys]
    return type(kjt)(
        keys=keys,
        values=torch.cat([v for v, _ in per_key]),
        lengths=torch.cat([n.to(kjt.lengths().dtype) for _, n in per_key]),
    )


def collate_retrieval(samples: Sequence[RetrievalSample], catalog_size: int = 0) -> RetrievalBatch:
    """Collate samples into a `RetrievalBatch`; `catalog_size > 0` spreads item ids
    `0 .. catalog_size - 1` over the samples' `catalog` feature, in order. Samples with several
    negatives per target give the batch form of `RetrievalBatch.neg_index`."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    per_sample = -(-catalog_size // len(samples))
    catalog = [min(per_sample, max(0, catalog_size - b * per_sample)) for b in range(len(samples))]
    fields = (
        [s.inputs for s in samples],
        [s.targets for s in samples],
        [s.negatives for s in samples],
        [s.candidates for s in samples],
    )
    values = np.concatenate(
        [np.asarray(ids, dtype=np.int64) for field in fields for ids in field]
        + [np.arange(catalog_size, dtype=np.int64)]
    )
    lengths = [len(ids) for field in fields for ids in field] + catalog
    kjt = KeyedJaggedTensor(
        keys=list(RETRIEVAL_KEYS),
        values=torch.from_numpy(values),
        lengths=torch.tensor(lengths, dtype=torch.int32),
    )
    batch = RetrievalBatch(
        sparse_features=kjt,
        timestamps=torch.tensor(np.concatenate([np.asarray(s.timestamps, dtype=np.int64) for s in samples])),
        sample_ids=torch.tensor([s.sample_id for s in samples], dtype=torch.int64),
        target_timestamps=torch.tensor([s.target_timestamp for s in samples], dtype=torch.int64),
    )
    targets = sum(len(s.targets) for s in samples)
    several = targets and sum(len(s.negatives) for s in samples) > targets
    return batch.with_negatives(batch.sparse_features[NEG_KEY].values()) if several else batch
