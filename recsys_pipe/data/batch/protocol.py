"""The batch protocol every batch follows, and `TensorBatch`, the shared base that implements it.

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

The batches themselves sit beside this module: the sequence batch of HSTU ranking
(`sequence.py`), the retrieval batch (`retrieval.py`) and the tabular batches of the DLRM family
(`tabular.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["TensorBatch", "jagged_select", "kjt_concat", "kjt_select", "register_with_torchrec"]

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
        fields = self._tensor_fields()
        for value in fields.values():
            _host_metadata(value)
        moved = {name: value.to(device, non_blocking=non_blocking) for name, value in fields.items()}
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


def _host_metadata(value: Any) -> None:
    """Before a KJT leaves the host: its keys' lengths and offsets, as host lists (torchrec keeps
    them in the KJT, and `to()` carries them over). Computed on the device they would be a read of
    device values, a host sync, in every input distribution (`KeyedJaggedTensor.length_per_key`);
    here they are a sum over a host tensor. Other fields are left alone."""
    if hasattr(value, "length_per_key") and hasattr(value, "offset_per_key") and value.device().type == "cpu":
        value.offset_per_key()  # computes (and keeps) length_per_key first


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
