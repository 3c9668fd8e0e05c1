"""Training batches: the protocol every batch follows, its shared base, and the sequence batch.

The batch protocol (what the task functions, torchrec's pipeline and the balanced shuffler use):

* `to(device, non_blocking)`, `record_stream(stream)`, `pin_memory()`: torchrec's `Pipelineable`
  interface (moving a batch, keeping it alive on other CUDA streams, pinning host memory).
* `empty_like(device)`, `copy_(src, non_blocking)`: the in-place copy (torchrec's
  `enable_inplace_copy_batch`): allocate the device batch on one stream, fill it on another.
* `sample_ids`: `[B]` int64, globally unique sample ids (checks that every sample is trained
  exactly once, whatever the plan).
* `num_loss_tokens()`: 1-element tensor on the batch's device, how many terms the model's loss
  averages over on this rank (global-token loss normalisation).
* `sparse_features`: a `KeyedJaggedTensor` attribute, for models with torchrec tables (torchrec's
  model rewrite finds the sharded module's input as an attribute of the batch).
* `select(index)`, `concat(batches)`: the samples at `index`, in that order; one batch of all
  samples of `batches` in order. Only the balanced batch shuffler needs them.

`TensorBatch` implements the first group for any dataclass of tensors and KJTs, and registers as a
torchrec `Pipelineable` when torchrec is loaded (`register_with_torchrec`), so this module never
imports torchrec itself: a model with plain torch tables trains where torchrec is not installed.

The sequence batch (`SequenceBatch`, built from `Sample`s by `collate`) feeds HSTU; the Criteo
batch lives in `recsys_pipe.data.in_memory.criteo`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "ACTION_KEY",
    "ITEM_KEY",
    "MASKED_ACTION",
    "USER_KEY",
    "Sample",
    "SequenceBatch",
    "TensorBatch",
    "collate",
    "jagged_select",
    "kjt_concat",
    "kjt_select",
    "register_with_torchrec",
]

ITEM_KEY = "item"
ACTION_KEY = "action"
USER_KEY = "user"
MASKED_ACTION = 0
"""Action id fed for candidate tokens: their real action is the label, so it must stay hidden."""

B = TypeVar("B", bound="TensorBatch")


class TensorBatch:
    """Base of the batch dataclasses: moves, pins and stream-records every field that is a tensor
    or a KJT (anything with `record_stream`); other fields are carried as they are."""

    sample_ids: torch.Tensor

    def _tensor_fields(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if hasattr(getattr(self, f.name), "record_stream")
        }

    def to(self: B, device: torch.device | str, non_blocking: bool = False, data_copy_stream: Any = None) -> B:
        """This batch on `device`. With `data_copy_stream` (torchrec's in-place copy, as its
        pipelines call it with `enable_inplace_copy_batch`): allocated on the current stream and
        filled on `data_copy_stream` after it waited for the allocation."""
        if data_copy_stream is not None:
            moved = self.empty_like(device)
            current = torch.get_device_module(data_copy_stream.device).current_stream()
            with torch.get_device_module(data_copy_stream.device).stream(data_copy_stream):
                data_copy_stream.wait_stream(current)
                return moved.copy_(self, non_blocking=non_blocking)
        moved = {name: value.to(device, non_blocking=non_blocking) for name, value in self._tensor_fields().items()}
        return dataclasses.replace(self, **moved)  # type: ignore[type-var]

    def record_stream(self, stream: Any) -> None:
        """Record every tensor field on `stream`, so the caching allocator keeps it until that stream's work is done."""
        for value in self._tensor_fields().values():
            value.record_stream(stream)

    def empty_like(self: B, device: torch.device | str) -> B:
        """A batch of uninitialised tensors shaped like this one's on `device`, allocated on the
        current stream (a KJT through its own `empty_like`, which keeps its lengths' layout)."""
        empty = {
            name: torch.empty_like(value, device=device)
            if isinstance(value, torch.Tensor)
            else type(value).empty_like(value, device=device)
            for name, value in self._tensor_fields().items()
        }
        return dataclasses.replace(self, **empty)  # type: ignore[type-var]

    def copy_(self: B, src: B, non_blocking: bool = False) -> B:
        """Copy `src`'s tensors into this batch's (made by `src.empty_like`), on the current stream."""
        mine = self._tensor_fields()
        for name, value in src._tensor_fields().items():
            mine[name].copy_(value, non_blocking=non_blocking)
        return self

    def pin_memory(self: B) -> B:
        """Called by the DataLoader (`pin_memory=True`) so `to(non_blocking=True)` is asynchronous."""
        return dataclasses.replace(  # type: ignore[type-var]
            self, **{name: value.pin_memory() for name, value in self._tensor_fields().items()}
        )

    @property
    def batch_size(self) -> int:
        """The number of samples (`sample_ids`' length)."""
        return int(self.sample_ids.numel())

    def num_loss_tokens(self) -> torch.Tensor:
        """The number of loss terms of the batch (a 0-d int64 tensor, on the batch's device).

        Subclasses implement it; `global_tokens_allreduce` sums it over the ranks."""
        raise NotImplementedError(f"{type(self).__name__} does not count its loss tokens")

    def select(self: B, index: torch.Tensor) -> B:
        """The samples at `index` (a `[k]` int64 tensor of positions), as a new batch.

        Subclasses implement it for the batch shuffler; this base raises NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} cannot select samples (needed by the batch shuffler)")

    @classmethod
    def concat(cls: type[B], batches: Sequence[B]) -> B:
        """The samples of `batches`, in order, as one batch.

        Subclasses implement it for the batch shuffler; this base raises NotImplementedError."""
        raise NotImplementedError(f"{cls.__name__} cannot concatenate batches (needed by the batch shuffler)")


def register_with_torchrec() -> None:
    """Make every `TensorBatch` a virtual subclass of torchrec's `Pipelineable`: torchrec's own
    pipelines (`TrainPipelineSparseDist`) check `isinstance(batch, Pipelineable)`. Called by the
    modules that bring torchrec in (sharding); idempotent."""
    from torchrec.streamable import Pipelineable

    Pipelineable.register(TensorBatch)


# -- jagged helpers (plain torch: any device, no torchrec) ---------------------------------------


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def jagged_select(
    values: torch.Tensor, lengths: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The segments `index` (in that order) of a jagged tensor whose rows `values` are grouped
    into consecutive segments of `lengths` rows; returns their rows and lengths."""
    lengths64 = lengths.long()
    index = index.to(lengths.device)
    starts = _offsets(lengths64)[:-1][index]
    selected = lengths64[index]
    total = int(selected.sum())
    segment = torch.repeat_interleave(torch.arange(index.numel(), device=lengths.device), selected, output_size=total)
    within = torch.arange(total, device=lengths.device) - _offsets(selected)[:-1][segment]
    return values[starts[segment] + within], lengths[index]


def kjt_select(kjt: KeyedJaggedTensor, index: torch.Tensor) -> KeyedJaggedTensor:
    """The samples `index` of a KJT (every key), in that order."""
    keys = kjt.keys()
    stride = kjt.stride()
    index = index.to(kjt.lengths().device)
    segments = (torch.arange(len(keys), device=index.device)[:, None] * stride + index[None, :]).reshape(-1)
    values, lengths = jagged_select(kjt.values(), kjt.lengths(), segments)
    weights = kjt.weights_or_none()
    if weights is not None:
        weights = jagged_select(weights, kjt.lengths(), segments)[0]
    return type(kjt)(keys=keys, values=values, lengths=lengths, weights=weights)


def kjt_concat(kjts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """One KJT holding the samples of `kjts` in order (same keys in the same order)."""
    keys = kjts[0].keys()
    values: list[list[torch.Tensor]] = [[] for _ in keys]
    lengths: list[list[torch.Tensor]] = [[] for _ in keys]
    weights: list[list[torch.Tensor]] = [[] for _ in keys]
    weighted = kjts[0].weights_or_none() is not None
    for kjt in kjts:
        if kjt.keys() != keys:
            raise ValueError(f"cannot concatenate KJTs with keys {keys} and {kjt.keys()}")
        per_key = kjt.lengths().view(len(keys), kjt.stride())
        counts = per_key.sum(dim=1).tolist()
        for k, (v, length) in enumerate(zip(torch.split(kjt.values(), counts), per_key)):
            values[k].append(v)
            lengths[k].append(length)
        if weighted:
            for k, w in enumerate(torch.split(kjt.weights(), counts)):
                weights[k].append(w)
    return type(kjts[0])(
        keys=keys,
        values=torch.cat([v for per in values for v in per]),
        lengths=torch.cat([length for per in lengths for length in per]),
        weights=torch.cat([w for per in weights for w in per]) if weighted else None,
    )


# -- the sequence batch ---------------------------------------------------------------------------


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
