"""`data=parquet_sequences`: per-user item sequences streamed from Parquet (next-item retrieval:
SASRec and HSTU retrieval), with `data=sequences`'s keys, samples and leave-one-out splits. For
HSTU ranking the same source reads windows of ratings instead: a model names the kind of source
it trains on (`ModelConfig.data_kind`) and `ParquetSequencesDataConfig.as_kind` turns this config
into that kind's (`recsys_pipe.data.parquet.ranking`, which shares this module's decoder).

The layout (`recsys-data convert sequences` writes it; `data.columns` renames the columns): one
row per user, `user_id` (int64, the raw id), `item_ids` (list<int64>, raw ids, chronological),
optionally `timestamps` (list<int64>, the same lengths; without it the position in the sequence
stands in for time) and `actions` (the ratings: read by HSTU ranking, not by the retrieval
models). Rows are in sorted user-id order, so a row's 0-based position over the files is the
dense user id that `data=sequences` gives the same user (its sample id).

Items become dense ids `[0, n)` in sorted raw-id order, as `data=sequences` numbers them, from a
vocabulary stored at conversion: the key `recsys-pipe/items` of the first file's key-value
metadata holds the sorted distinct raw item ids as little-endian int64 bytes
(`item_vocab_metadata`). So nothing scans the items before the first step. Files without it need
`data.num_items`: their item ids are then taken as dense ids, checked to be in `[0, num_items)`.

A user's training sample is what `data=sequences` builds (module `recsys_pipe.data.in_memory.sequences`):
the last `max_seq_len` transitions of the sequence without its last two items (all of it below
three items), and `negatives_per_target` negatives per target (one, or what the model derives:
`SequenceSourceConfig.negatives_per_target`) from `recsys_pipe.data.negatives.unseen_items` (a
counter-based hash of `(data.seed, epoch, user, position)`, rejected against the user's training
items), drawn for many users at once: bitwise the same batches as `data=sequences` on the same
users, whichever batch, rank or worker a user falls in. Nothing is per user. Unlike
`data=sequences`, every row is a sample, so that the batches per epoch follow from the row counts
alone: a user with fewer than two training transitions (1 or 3 interactions) is a sample without
targets, which adds nothing to the loss.

Decoding: a shuffled window (65,536 users by default: 13M items at length 200) is handed out
in parts of `_PART_ROWS` users, the same rows in the same order (`ParquetSequences.epoch_pieces`):
the worker reads the window's row groups and maps its item ids to dense ids once (into arrays
reused window after window), and each part's users index those columns where they lie: a part's
samples and negatives are written once, into the shared block the part crosses to the main
process in (`recsys_pipe.data.parquet.stream`, "The hand-off"), with no gather of its users' items
first. A first batch waits for one part.

Evaluation (`split("valid" | "test")`): rank `r` scores a contiguous `1/W` of the users; a user
with fewer than 3 interactions is padding (not scored), as the ranks' splits are padded alike.
"""

from __future__ import annotations

import copy
import ctypes
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, ClassVar, Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationInfo, field_validator
from torch.utils.data import Dataset, get_worker_info

from recsys_pipe.config import (
    ConfigError,
    ConfigProblem,
    Section,
    builder_field,
    home_expanded,
    import_fn,
    validate_section,
)
from recsys_pipe.data.batch import DataSpec
from recsys_pipe.data.in_memory.sequences import (
    INPUT_KEY,
    RETRIEVAL_KEYS,
    SPLITS,
    RetrievalBatch,
    RetrievalSample,
    SequencesDataConfig,
    collate_retrieval,
)
from recsys_pipe.data.jagged import concat_ranges, offsets_of
from recsys_pipe.data.negatives import EVAL, TRAIN, unseen_items
from recsys_pipe.data.parquet.checks import RowProblems, list_column, null_rows
from recsys_pipe.data.parquet.files import Collected, DataFileError, ParquetFiles, RowGroupStats, open_parquet
from recsys_pipe.data.parquet.stream import (
    Alloc,
    EpochOrder,
    Fail,
    Piece,
    ReusedArrays,
    StreamSource,
    WindowDataset,
    shared_empty,
)
from recsys_pipe.data.serving import SEQUENCE_COLUMNS, id_record, retrieval_features, retrieval_row
from recsys_pipe.data.source import DataConfig

__all__ = [
    "ITEM_NAMES_KEY",
    "ITEM_VOCAB_KEY",
    "RATING_SCALE_KEY",
    "USER_NAMES_KEY",
    "WINDOWS_KEY",
    "RETRIEVAL_MAX_SEQ_LEN",
    "ItemStats",
    "ParquetSequenceKeys",
    "ParquetSequencesDataConfig",
    "PartedStreamSource",
    "SequenceColumns",
    "check_sequence_columns",
    "item_vocab_metadata",
    "names_metadata",
    "parquet_sequences_dataset",
    "stored_names",
]

ITEM_VOCAB_KEY = b"recsys-pipe/items"
#: text ids: the file holds their numbers, these keys their texts in that order (a JSON list)
ITEM_NAMES_KEY, USER_NAMES_KEY = b"recsys-pipe/item-names", b"recsys-pipe/user-names"
#: the ratings' scale, `(0, scale]` (text; absent: 5, MovieLens's stars)
RATING_SCALE_KEY = b"recsys-pipe/rating-scale"
#: the window cut of files whose rows are windows, for HSTU ranking (`recsys_pipe.data.parquet.ranking`)
WINDOWS_KEY = b"recsys-pipe/windows"


def names_metadata(users: Sequence[str], items: Sequence[str]) -> dict[bytes, bytes]:
    """The key-value metadata of text ids: the users' and the items' texts, in the order of their
    numbers (a converter numbers text ids in sorted order)."""
    return {USER_NAMES_KEY: json.dumps(list(users)).encode(), ITEM_NAMES_KEY: json.dumps(list(items)).encode()}


def stored_names(files: ParquetFiles, key: bytes) -> list[str] | None:
    """The texts of the ids numbered by a converter (`names_metadata`), or None."""
    stored = files.metadata.get(key)
    return None if stored is None else json.loads(stored)


def item_vocab_metadata(raw_items: np.ndarray) -> dict[bytes, bytes]:
    """The key-value metadata that carries a sequence file's item vocabulary (its sorted distinct
    raw item ids); a converter adds it to the first file's schema metadata."""
    vocab = np.unique(np.asarray(raw_items, dtype=np.int64))
    return {ITEM_VOCAB_KEY: vocab.astype("<i8").tobytes()}


class SequenceColumns(Section):
    """Column names of `data=parquet_sequences` (`data.columns.*`)."""

    user: StrictStr = Field("user_id", description="the user id column (an integer)")
    items: StrictStr = Field("item_ids", description="the item-id list column (chronological)")
    timestamps: StrictStr | None = Field(
        "timestamps", description="the timestamp list column (absent or null: the positions stand in for time)"
    )
    actions: StrictStr | None = Field(
        "actions",
        description="HSTU ranking: the per-event rating list column (numbers, the same lengths), which gives the "
        "action ids and the labels; not read by the retrieval models",
    )


#: `data.max_seq_len` of next-item retrieval when it is null (as `data=sequences`)
RETRIEVAL_MAX_SEQ_LEN = 50


class ParquetSequenceKeys(Section):
    """The keys `data=parquet_sequences` has for both kinds of model: the files, their columns,
    the shuffle window, and the sample shape of HSTU ranking (`recsys_pipe.data.parquet.ranking`).
    `ParquetSequencesDataConfig` (what `data=parquet_sequences` validates) and the HSTU ranking
    config it becomes for a ranking model share them."""

    path: StrictStr | list[StrictStr] = Field(
        description="sequence Parquet file, directory, glob or URI (file://, s3://, gs://, hdfs://), or a list"
    )
    columns: SequenceColumns = Field(default_factory=SequenceColumns, description="the columns' names")
    num_items: StrictInt | None = Field(
        None,
        ge=2,
        description="files without a stored item vocabulary: their item ids are dense ids in [0, num_items)",
    )
    shuffle_window: StrictInt = Field(
        65536, ge=1, description="samples shuffled together (rounded down to a multiple of data.batch_size)"
    )
    max_seq_len: StrictInt | None = Field(
        None,
        ge=2,
        description=f"most recent interactions a sample feeds the model (null: {RETRIEVAL_MAX_SEQ_LEN} for next-item "
        "retrieval; HSTU ranking: the window length the files were converted with)",
    )
    num_candidates: StrictInt | None = Field(
        None,
        ge=1,
        description="HSTU ranking: trailing events of each sample that are ranked (null: as the files were converted)",
    )
    use_user_feature: StrictBool = Field(False, description="HSTU ranking: add the user id as a contextual token")
    thresholds: list[float] = Field(
        [4.0, 5.0],
        min_length=1,
        description="HSTU ranking: one binary task per threshold: a candidate is positive for task k when its rating "
        ">= thresholds[k]",
    )

    # replaces a parent's check that data.path is one readable file
    @field_validator("path")
    @classmethod
    def _readable_file(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("an empty list names no file")
        return home_expanded(value)

    # replaces a parent's check of num_candidates against max_seq_len: either may be null here
    @field_validator("num_candidates")
    @classmethod
    def _candidates_fit(cls, num_candidates: int | None, info: ValidationInfo) -> int | None:
        max_seq_len = info.data.get("max_seq_len")
        if isinstance(max_seq_len, int) and isinstance(num_candidates, int) and num_candidates >= max_seq_len:
            raise ValueError(
                f"num_candidates ({num_candidates}) must be < max_seq_len ({max_seq_len}): "
                "a sample needs at least one history token"
            )
        return num_candidates


class ParquetSequencesDataConfig(ParquetSequenceKeys, SequencesDataConfig):
    """`data=parquet_sequences`: sequence Parquet for next-item retrieval (SASRec, HSTU retrieval)
    or HSTU ranking, whichever the model trains on (`as_kind`; docs/parquet.md)."""

    SIZE_KEY: ClassVar[str] = "data.path"

    name: Literal["parquet_sequences"] = "parquet_sequences"  # type: ignore[assignment]
    builder: StrictStr | None = builder_field("recsys_pipe.data.parquet.sequences:parquet_sequences_dataset")

    #: the configs this source becomes for other kinds of model (`as_kind`), by import path as the
    #: registries name config classes: the HSTU ranking source builds on this module
    VARIANTS: ClassVar[tuple[str, ...]] = ("recsys_pipe.data.parquet.ranking:ParquetRankingDataConfig",)

    def as_kind(self, kind: type[DataConfig]) -> DataConfig:
        """Next-item retrieval (`kind` a `SequenceSourceConfig`): this config, `max_seq_len`
        filled in. HSTU ranking (`kind` a `SequenceDataConfig`, the `Sample` sources): the
        variant of that kind (`ParquetRankingDataConfig`) with the keys the two share. Any other
        kind: this config (the model's `check_data` then refuses it)."""
        if isinstance(self, kind):
            if self.max_seq_len is not None:
                return self
            return self.model_copy(update={"max_seq_len": RETRIEVAL_MAX_SEQ_LEN})
        for path in self.VARIANTS:
            variant = import_fn(path)
            if issubclass(variant, kind):
                keys = variant.model_fields.keys() - {"builder"}
                return validate_section(variant, self.model_dump(include=set(keys)), "data")
        return self


def _list_type(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


@dataclass
class UserRows:
    """Decoded users: some rows of a window's decoded columns (`window`: dense item ids and
    timestamps, flat, with their offsets; user and sample ids), those of `order` in that order
    (None: all, as they lie). Row `i`'s items are `window.items[starts[i]:starts[i] + lengths[i]]`:
    training reads them there (`finish`), without gathering the rows' items first; `items`,
    `stamps` and `offsets` are the rows' own, gathered when first read (HSTU ranking, evaluation).
    Without a timestamp column the positions in each sequence stand in for time."""

    window: _Columns
    order: np.ndarray | None
    source: _SequenceDecoder
    #: where the tensors of the training rows are allocated (`finish`)
    alloc: Alloc = shared_empty

    def __post_init__(self) -> None:
        offsets = self.window.offsets
        if self.order is None:
            self.starts, self.lengths = offsets[:-1], np.diff(offsets)
        else:
            self.starts = offsets[:-1][self.order]
            self.lengths = offsets[1:][self.order] - self.starts

    def __len__(self) -> int:
        return len(self.lengths)

    @cached_property
    def users(self) -> np.ndarray:
        return self.window.users if self.order is None else self.window.users[self.order]

    @cached_property
    def sample_ids(self) -> np.ndarray:
        return self.window.sample_ids if self.order is None else self.window.sample_ids[self.order]

    @cached_property
    def offsets(self) -> np.ndarray:
        """The rows' own offsets into `items` and `stamps`."""
        return self.window.offsets if self.order is None else offsets_of(self.lengths)

    @cached_property
    def items(self) -> np.ndarray:
        """The rows' dense item ids, row after row."""
        return self.window.items if self.order is None else self.window.items[self._gather]

    @cached_property
    def stamps(self) -> np.ndarray:
        """Each of `items`' timestamp (the positions in its sequence without a timestamp column)."""
        given = self.window.stamps
        if given is None:
            return concat_ranges(np.zeros(len(self.lengths), dtype=np.int64), self.lengths)
        return given if self.order is None else given[self._gather]

    @cached_property
    def _gather(self) -> np.ndarray:
        return concat_ranges(self.starts, self.lengths)

    def finish(self, epoch: int) -> TrainRows:
        """The training samples of these users in `epoch` (see the module docstring), in tensors
        from `alloc`, each written once from the window's columns."""
        d, window, alloc = self.source, self.window, self.alloc
        n = self.lengths
        train = np.where(n >= 3, n - 2, n)
        keep = np.minimum(train, d.max_seq_len + 1)
        m = np.maximum(keep - 1, 0)  # transitions: inputs and targets of each sample
        k, users, total = d.negatives_per_target, len(n), int(m.sum())
        inputs, targets, stamps = (alloc((total,), torch.int64) for _ in range(3))
        negatives = alloc((total * k,), torch.int64)
        offsets, sample_ids, target_stamps = (
            alloc((users + 1,), torch.int64),
            *(alloc((users,), torch.int64) for _ in range(2)),
        )
        at = concat_ranges(self.starts + train - keep, m)  # the inputs' places in the window's columns
        # (the indices are in range: `clip` skips numpy's check, which buffers the output)
        np.take(window.items, at, out=inputs.numpy(), mode="clip")
        unseen_items(
            d.seed,
            TRAIN,
            epoch,
            self.sample_ids,
            m * k,
            window.items,
            self.starts,
            train,
            d.num_items,
            out=negatives.numpy(),
        )
        if window.stamps is None:  # positions: of each input, and of each sample's last target
            concat_ranges(train - keep, m, out=stamps.numpy())
            np.maximum(train - 1, 0, out=target_stamps.numpy())
        else:
            np.take(window.stamps, at, out=stamps.numpy(), mode="clip")
            # each sample's last target (the first item of the rows when it has none), as data=sequences has it
            first = self.starts[n > 0][:1]
            last = np.where(train > 0, self.starts + train - 1, first[0] if len(first) else 0)
            if len(window.stamps):
                np.take(window.stamps, last, out=target_stamps.numpy(), mode="clip")
            else:
                target_stamps.zero_()
        at += 1  # the targets
        np.take(window.items, at, out=targets.numpy(), mode="clip")
        offsets.numpy()[0] = 0
        np.cumsum(m, out=offsets.numpy()[1:])
        sample_ids.numpy()[:] = self.sample_ids
        return TrainRows(inputs, targets, negatives, stamps, offsets, sample_ids, target_stamps, k)


@dataclass
class TrainRows:
    """Training samples: inputs, targets and timestamps (the same lengths) per user, and
    `negatives_per_target` negatives per target (target by target)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    negatives: torch.Tensor
    stamps: torch.Tensor
    offsets: torch.Tensor
    sample_ids: torch.Tensor
    #: `[users]` the time of each sample's last target (`RetrievalBatch.target_timestamps`)
    target_stamps: torch.Tensor
    negatives_per_target: int = 1

    def __len__(self) -> int:
        return int(self.sample_ids.numel())

    def copy(self) -> TrainRows:
        """These rows in tensors of their own."""
        return TrainRows(
            self.inputs.clone(),
            self.targets.clone(),
            self.negatives.clone(),
            self.stamps.clone(),
            self.offsets.clone(),
            self.sample_ids.clone(),
            self.target_stamps.clone(),
            self.negatives_per_target,
        )

    def slice(self, start: int, stop: int) -> TrainRows:
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        k = self.negatives_per_target
        return TrainRows(
            self.inputs[lo:hi],
            self.targets[lo:hi],
            self.negatives[lo * k : hi * k],
            self.stamps[lo:hi],
            self.offsets[start : stop + 1] - lo,
            self.sample_ids[start:stop],
            self.target_stamps[start:stop],
            k,
        )

    @classmethod
    def concat(cls, parts: Sequence[TrainRows]) -> TrainRows:
        lengths = torch.cat([p.offsets[1:] - p.offsets[:-1] for p in parts])
        return TrainRows(
            torch.cat([p.inputs for p in parts]),
            torch.cat([p.targets for p in parts]),
            torch.cat([p.negatives for p in parts]),
            torch.cat([p.stamps for p in parts]),
            torch.from_numpy(offsets_of(lengths.numpy())),
            torch.cat([p.sample_ids for p in parts]),
            torch.cat([p.target_stamps for p in parts]),
            parts[0].negatives_per_target,  # one source: the same in every part
        )

    def batch(self) -> RetrievalBatch:
        """The batch `collate_retrieval` makes of these samples (no candidates, no catalogue), in
        tensors of its own (these rows may be views of a worker's shared block)."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        b = len(self)
        lengths = (self.offsets[1:] - self.offsets[:-1]).to(torch.int32)
        zeros = torch.zeros(2 * b, dtype=torch.int32)
        kjt = KeyedJaggedTensor(
            keys=list(RETRIEVAL_KEYS),
            values=torch.cat([self.inputs, self.targets, self.negatives]),
            lengths=torch.cat([lengths, lengths, lengths * self.negatives_per_target, zeros]),
        )
        batch = RetrievalBatch(
            sparse_features=kjt,
            timestamps=self.stamps.clone(),
            sample_ids=self.sample_ids.clone(),
            target_timestamps=self.target_stamps.clone(),
        )
        return batch.with_negatives(self.negatives) if self.negatives_per_target > 1 else batch


#: raw item ids up to this many (or 4x the vocabulary) map to dense ids through a table, not a search
_LOOKUP_ROWS = 1 << 22


@dataclass
class _Columns:
    """A table's rows as numpy: dense item ids (flat) and their offsets, user ids, timestamps
    (flat; None: positions stand in) and the rows' sample ids."""

    items: np.ndarray
    offsets: np.ndarray
    users: np.ndarray
    stamps: np.ndarray | None
    sample_ids: np.ndarray


class _SequenceDecoder:
    """Turns a row group of sequence Parquet into `UserRows` (dense item ids). A `BlockDecoder`:
    the training rows its rows become (`UserRows.finish`) are allocated with the `alloc` given.

    A window's decoded columns are kept for its next part and live in arrays reused by the next
    window (a window of 65,536 length-200 users maps 105 MB of item ids: fresh memory would
    page-fault every window). So rows it returned are valid until it decodes another table: a
    user that keeps rows (`_Rows`) has a decoder of its own (`copy`)."""

    def __init__(
        self,
        cfg: ParquetSequencesDataConfig,
        vocab: np.ndarray | None,
        num_items: int,
        stamps: str | None,
        negatives_per_target: int = 1,
        names: ParquetFiles | None = None,
    ):
        c = cfg.columns
        #: the texts of ids a converter numbered (`names_metadata`), read from `names`' metadata
        self.item_names = None if names is None else stored_names(names, ITEM_NAMES_KEY)
        self.user_names = None if names is None else stored_names(names, USER_NAMES_KEY)
        self.user, self.items, self.stamps = c.user, c.items, stamps
        self.columns = [c.user, c.items] + ([stamps] if stamps else [])
        self.vocab, self.num_items = vocab, num_items
        self.max_seq_len, self.seed = cfg.max_seq_len, cfg.seed
        #: training negatives per target (retrieval; the HSTU ranking decoder draws none)
        self.negatives_per_target = negatives_per_target
        #: the most bytes of a training row (`UserRows.finish`): inputs, targets, timestamps and
        #: negatives of at most `max_seq_len` transitions, its offset, sample id and target time
        self.row_bytes = 8 * ((3 + negatives_per_target) * int(self.max_seq_len) + 4)
        #: raw id -> dense id (-1: unknown) when the raw ids are small enough for a table
        self._lookup: np.ndarray | None = None
        if vocab is not None and vocab[0] >= 0 and vocab[-1] < max(_LOOKUP_ROWS, 4 * len(vocab)):
            self._lookup = np.full(int(vocab[-1]) + 1, -1, dtype=np.int64)
            self._lookup[vocab] = np.arange(len(vocab))
        self._cached: _Columns | None = None
        self._arrays = ReusedArrays()

    def items_record(self) -> dict[str, Any]:
        """How raw item ids become table rows (`features.json`): the vocabulary (of texts, where a
        converter numbered text ids), or the ids as they are."""
        if self.vocab is None:
            return id_record("as_is", self.num_items)
        return id_record("vocabulary", len(self.vocab), self.vocab if self.item_names is None else self.item_names)

    def named_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """A row as read (`read_rows`), its numbered user and item ids as the texts they were."""
        row = dict(row)
        if self.item_names is not None:
            row[self.items] = [self.item_names[i] for i in row[self.items]]
        if self.user_names is not None:
            row[self.user] = self.user_names[row[self.user]]
        return row

    def validate(self, table: pa.Table) -> RowProblems:
        """Every row `__call__` would refuse, check by check (`recsys_pipe.data.parquet.checks`)."""
        problems = RowProblems(table.num_rows)
        problems.add(self.user, null_rows(table.column(self.user)), "a null user id")
        flat, offsets, null_lists = list_column(table.column(self.items))
        problems.add(self.items, null_lists, "a null list of item ids")
        nulls = np.asarray(flat.is_null()) if flat.null_count else np.zeros(len(flat), dtype=bool)
        problems.add_values(self.items, nulls, offsets, "a null item id")
        raw = flat.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        problems.add_values(self.items, self._unknown(raw), offsets, lambda at: self._unknown_message(int(raw[at])))
        if self.stamps is not None:
            stamps, stamp_offsets, null_stamps = list_column(table.column(self.stamps))
            problems.add(self.stamps, null_stamps, "a null list of timestamps")
            bad = np.diff(stamp_offsets) != np.diff(offsets)
            problems.add(self.stamps, bad & ~null_stamps, f"a list of another length than {self.items!r}'s")
            stamp_nulls = np.asarray(stamps.is_null()) if stamps.null_count else np.zeros(len(stamps), dtype=bool)
            problems.add_values(self.stamps, stamp_nulls, stamp_offsets, "a null timestamp")
        return problems

    def _unknown(self, raw: np.ndarray) -> np.ndarray:
        """The raw item ids the decoder cannot map: not in the vocabulary, or outside [0, num_items)."""
        if self.vocab is None:
            return (raw < 0) | (raw >= self.num_items)
        place = np.minimum(np.searchsorted(self.vocab, raw), len(self.vocab) - 1)
        return self.vocab[place] != raw

    def _unknown_message(self, raw: int) -> str:
        if self.vocab is None:
            return f"item id {raw} outside [0, data.num_items={self.num_items})"
        return f"item id {raw} is not in the stored vocabulary ({ITEM_VOCAB_KEY.decode()})"

    def copy(self) -> _SequenceDecoder:
        """A decoder of the same columns with a cache and arrays of its own."""
        other = copy.copy(self)
        other._cached, other._arrays = None, ReusedArrays()
        return other

    def __call__(
        self,
        table: pa.Table,
        sample_ids: np.ndarray,
        order: np.ndarray | None,
        fail: Fail,
        alloc: Alloc = shared_empty,
    ) -> UserRows:
        """The rows `order` of the table (None: all): its columns are decoded and checked once
        (`_columns`), the rows index them."""
        return UserRows(self._columns(table, sample_ids, fail), order, self, alloc)

    def _columns(self, table: pa.Table, sample_ids: np.ndarray, fail: Fail) -> _Columns:
        """The table's columns as numpy, checked; kept for the next call on the same rows (the
        parts of one window are decoded from the window's table in turn)."""
        cached = self._cached
        if cached is not None and np.array_equal(cached.sample_ids, sample_ids):
            return cached
        self._cached = None  # release the previous window before decoding this one
        users = _one(table, self.user, fail)
        if users.null_count:
            raise fail(self.user, f"{users.null_count} null user id(s)")
        raw, offsets = _list_chunks(table.column(self.items), fail, self.items, "item ids")
        items = self._dense(raw, offsets, fail)
        stamps = None
        if self.stamps is not None:
            stamp_chunks, st_offsets = _list_chunks(table.column(self.stamps), fail, self.stamps, "timestamps")
            if not np.array_equal(st_offsets, offsets):
                raise fail(self.stamps, f"lists of other lengths than {self.items!r}")
            stamps = self._joined("stamps", stamp_chunks)
        user_ids = users.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        self._cached = _Columns(items, offsets, user_ids, stamps, sample_ids)
        return self._cached

    def _joined(self, name: str, chunks: list[np.ndarray]) -> np.ndarray:
        """The chunks as one array: the chunk itself if there is one, else joined in `name`'s reused array."""
        if len(chunks) == 1:
            return chunks[0]
        out, at = self._arrays(name, sum(len(c) for c in chunks), np.int64), 0
        for chunk in chunks:
            out[at : at + len(chunk)] = chunk
            at += len(chunk)
        return out

    def _dense(self, chunks: list[np.ndarray], offsets: np.ndarray, fail: Fail) -> np.ndarray:
        """The dense ids of the raw item ids `chunks` (one array), checked: each chunk is mapped
        straight into its place (no joined copy of the raw ids)."""
        if self.vocab is None and len(chunks) == 1:
            self._check_range(chunks[0], 0, offsets, fail)
            return chunks[0]
        dense = self._arrays("items", sum(len(c) for c in chunks), np.int64)
        at = 0
        for raw in chunks:
            self._dense_into(raw, dense[at : at + len(raw)], at, offsets, fail)
            at += len(raw)
        return dense

    def _dense_into(self, raw: np.ndarray, out: np.ndarray, at: int, offsets: np.ndarray, fail: Fail) -> None:
        """Map the raw ids `raw` (the window's from position `at` on) into `out`."""
        if self.vocab is None:
            self._check_range(raw, at, offsets, fail)
            out[:] = raw
            return
        unknown = None
        if self._lookup is not None:
            if raw.size and raw.min() >= 0 and raw.max() < len(self._lookup):  # the usual case: one gather
                np.take(self._lookup, raw, out=out, mode="clip")  # in range: `clip` skips the buffered check
                unknown = out < 0 if out.min() < 0 else None
            else:
                inside = (raw >= 0) & (raw < len(self._lookup))
                out[:] = np.where(inside, self._lookup[np.where(inside, raw, 0)], -1)
                unknown = out < 0
        else:
            out[:] = np.searchsorted(self.vocab, raw)
            unknown = (out >= len(self.vocab)) | (self.vocab[np.minimum(out, len(self.vocab) - 1)] != raw)
        if unknown is not None and unknown.any():
            bad, row = _first_bad(raw, unknown, at, offsets)
            raise fail(self.items, self._unknown_message(bad), row)

    def _check_range(self, raw: np.ndarray, at: int, offsets: np.ndarray, fail: Fail) -> None:
        """Dense ids as they are (no vocabulary): in `[0, num_items)`."""
        if raw.size and (raw.min() < 0 or raw.max() >= self.num_items):
            bad, row = _first_bad(raw, (raw < 0) | (raw >= self.num_items), at, offsets)
            raise fail(self.items, self._unknown_message(bad), row)


def _first_bad(raw: np.ndarray, bad: np.ndarray, at: int, offsets: np.ndarray) -> tuple[int, int]:
    """The first bad id of `raw` (the window's ids from position `at` on) and its user's row."""
    i = int(np.flatnonzero(bad)[0])
    return int(raw[i]), int(np.searchsorted(offsets, at + i, side="right")) - 1


def _one(table: pa.Table, name: str, fail: Fail) -> pa.Array:
    col = table.column(name)
    return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)


def _list_chunks(column: pa.ChunkedArray, fail: Fail, name: str, what: str) -> tuple[list[np.ndarray], np.ndarray]:
    """A list column's values, one int64 array per chunk (row-group slice, read in place), and
    the offsets of the whole column (`[rows + 1]`, from 0)."""
    values, offsets, at = [], [np.zeros(1, dtype=np.int64)], 0
    for chunk in column.chunks:
        flat = chunk.flatten()
        if chunk.null_count or flat.null_count:
            raise fail(name, f"null {what} or null lists")
        bounds = np.asarray(chunk.offsets, dtype=np.int64)
        offsets.append(bounds[1:] - bounds[0] + at)
        values.append(flat.to_numpy(zero_copy_only=False).astype(np.int64, copy=False))
        at += len(flat)
    return values, np.concatenate(offsets)


class _Rows:
    """Random access to users by global position (evaluation, dumps), one row group cached.
    With `skip` (`data.on_bad_row=skip`), a bad user is None (evaluation padding)."""

    def __init__(self, files: ParquetFiles, decoder: _SequenceDecoder, skip: bool = False) -> None:
        self.files, self.decoder = files, decoder.copy()  # its rows are kept while training decodes
        self.skip = skip
        units = files.units()
        self.first = units[:, 2]
        self.units = units
        #: the cached row group: its number, its (good) users, and each row's place among them (-1: bad)
        self._cached: tuple[int, UserRows, np.ndarray] | None = None

    def user(self, row: int) -> tuple[int, np.ndarray, np.ndarray] | None:
        """(raw user id, dense items, timestamps) of the user at global position `row`."""
        u = int(np.searchsorted(self.first, row, side="right")) - 1
        if self._cached is None or self._cached[0] != u:
            self._cached = (u, *self._group(u))
        _, rows, place = self._cached
        i = int(place[row - int(self.first[u])])
        if i < 0:
            return None
        lo, hi = rows.offsets[i], rows.offsets[i + 1]
        return int(rows.users[i]), rows.items[lo:hi], rows.stamps[lo:hi]

    def _group(self, u: int) -> tuple[UserRows, np.ndarray]:
        file, group, first = (int(x) for x in self.units[u])
        files = self.files
        table = files.read(file, group, self.decoder.columns)
        good = ~self.decoder.validate(table).bad if self.skip else np.ones(table.num_rows, dtype=bool)
        at = np.flatnonzero(good)

        def fail(column: str, message: str, row: int | None = None) -> DataFileError:
            return DataFileError(
                files.key, files.where(file, group, column, None if row is None else int(at[row])), message
            )

        ids = np.arange(first, first + table.num_rows, dtype=np.int64)[good]
        table = table if good.all() else table.filter(pa.array(good))
        return self.decoder(table, ids, None, fail), np.where(good, np.cumsum(good) - 1, -1)


class _RawUsers:
    """`raw_users[user]`: the raw id of a user (by dense id, the global position)."""

    def __init__(self, rows: _Rows) -> None:
        self.rows = rows

    def __getitem__(self, user: int) -> int | None:
        found = self.rows.user(user)
        return None if found is None else found[0]


#: users of a window that a worker turns into training rows at a time: a length-200 user's
#: rows are ~6 KB, so a part's arrays stay a few MB (in cache, not page-faulted in afresh as a
#: whole window's hundreds of MB are) and a first batch waits for one part, not the window
_PART_ROWS = 4096


class _Windows(WindowDataset):
    """`WindowDataset` for windows handed out in parts (`ParquetSequences.epoch_pieces`): the
    row groups read last stay cached, up to a window's rows plus two row groups (what a window
    can span), so each part of a window reads none of them again (with one worker the parts of a
    window reach it in turn; with several, each worker reads the window's groups once)."""

    def __init__(
        self, files: ParquetFiles, order: EpochOrder, decoder: _SequenceDecoder, window: int, skip: bool = False
    ) -> None:
        super().__init__(files, order, decoder, skip)
        self._groups: dict[tuple[int, int], pa.Table] = {}
        self._keep_rows = window + 2 * int(files.unit_rows().max(initial=0))

    def _group(self, file: int, group: int) -> pa.Table:
        table = self._groups.pop((file, group), None)
        if table is None:
            table = self.files.read(file, group, self.decoder.columns)
        self._groups[file, group] = table  # the most recently used last
        while sum(t.num_rows for t in self._groups.values()) > self._keep_rows and len(self._groups) > 1:
            del self._groups[next(iter(self._groups))]
        return table

    def __getitem__(self, piece: Piece) -> Any:
        _reuse_heap()
        return super().__getitem__(piece)


#: glibc's `mallopt` parameters: the size from which `malloc` maps memory of its own, and the
#: free memory at the heap's top above which `free` gives it back
_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1
_HEAP_SET_IN: list[int] = []  # the process that set them


def _reuse_heap() -> None:
    """In a DataLoader worker, let a part's arrays (a few MB each, allocated and freed in the same
    sizes part after part) come from the heap and stay there for the next part.

    Stream workers map every block from 128 KiB on (`recsys_pipe.data.parquet.stream`, against
    fragmentation by windows of changing sizes), so each such array is fresh memory: one page
    fault per 4 KiB. On the 2-core benchmark VM a fresh 6.4 MB array cost 1.9 ms to fill, a reused
    one 0.17 ms, and a part makes dozens. Mapped from 32 MiB on (glibc's most) and not trimmed
    below 256 MiB, they are reused; a window's own columns (larger) are still mapped. Other C
    libraries: nothing to do."""
    if get_worker_info() is None or os.getpid() in _HEAP_SET_IN:
        return
    _HEAP_SET_IN[:] = [os.getpid()]
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20)
    except (OSError, AttributeError):
        pass


class PartedStreamSource(StreamSource):
    """A `StreamSource` whose training windows are handed out in parts of `_PART_ROWS` rows
    (a multiple of the batch size), the row groups kept between the parts (`_Windows`): the
    same rows in the same order, with a first batch that waits for one part. Its decoder keeps
    a window's decoded columns for the window's next part (`_SequenceDecoder`)."""

    def prepare(self, eval_batches: int) -> None:
        super().prepare(eval_batches)
        skip = self.train_windows.skip
        self.train_windows = _Windows(self.files, self.order, self.decoder, self.window, skip)  # type: ignore[arg-type]

    @property
    def piece_rows(self) -> int:
        """The rows of a part: `_PART_ROWS`, rounded down to a multiple of the batch size."""
        return max(self.batch_size, _PART_ROWS // self.batch_size * self.batch_size)

    def epoch_pieces(self, epoch: int) -> list[Piece]:
        """The windows of `StreamSource.epoch_pieces`, each handed out in parts of
        `piece_rows` rows (a multiple of the batch size): the same rows in the same order."""
        part = self.piece_rows
        return [
            Piece(p.epoch, p.start, p.length, p.skip + at, min(part, p.take - at))
            for p in super().epoch_pieces(epoch)
            for at in range(0, p.take, part)
        ]


class ParquetSequences(PartedStreamSource):
    """This rank's users of sequence Parquet: training by position (`StreamSource`) and the
    leave-one-out evaluation splits (`split`), as `SequencesDataset` offers them."""

    def __init__(self, files: ParquetFiles, decoder: _SequenceDecoder, rank: int, world_size: int, cfg: Any) -> None:
        spec = DataSpec(num_tasks=1, vocab_sizes={INPUT_KEY: decoder.num_items})
        super().__init__(files, decoder, rank, world_size, cfg, spec)
        self.num_items = decoder.num_items
        self.seed, self.max_seq_len = cfg.seed, cfg.max_seq_len
        self.eval_negatives, self.full_eval = cfg.eval_negatives, cfg.full_eval
        self.raw_items = decoder.vocab if decoder.vocab is not None else np.arange(decoder.num_items)
        self._rows = _Rows(files, decoder, skip=cfg.on_bad_row == "skip")
        self.raw_users = _RawUsers(self._rows)

    def prepare(self, eval_batches: int) -> None:
        super().prepare(0)  # evaluation is the leave-one-out splits, not held-out rows

    def serving_features(self) -> dict[str, Any]:
        """Items through the stored vocabulary, or as dense ids (`recsys_pipe.data.serving`)."""
        decoder = self.decoder
        assert isinstance(decoder, _SequenceDecoder)
        return retrieval_features(decoder.items_record(), decoder.stamps is not None, self.max_seq_len, self.columns)

    @property
    def columns(self) -> dict[str, str]:
        c = self.cfg.columns
        return {"user": c.user, "items": c.items, "timestamps": c.timestamps or SEQUENCE_COLUMNS["timestamps"]}

    def raw_rows(self, sample_ids: Sequence[int], split: str | None) -> list[dict[str, Any]]:
        """Each user's row (by global position) cut before its held-out item of `split`."""
        rows = []
        for user in map(int, sample_ids):
            found = self._rows.user(user)
            assert found is not None  # a held-out sample is never a skipped row
            raw_user, seq, stamps = found
            decoder = self.decoder
            assert isinstance(decoder, _SequenceDecoder)
            user = raw_user if decoder.user_names is None else decoder.user_names[raw_user]
            raw = self.raw_items[seq].tolist()
            raw = raw if decoder.item_names is None else [decoder.item_names[i] for i in raw]
            rows.append(retrieval_row(user, raw, stamps.tolist(), split, decoder.stamps is not None, self.columns))
        return rows

    @property
    def num_users(self) -> int:
        return self.files.num_rows

    def held_out(self, user: int, split: str) -> int:
        """The dense id of `user`'s held-out item of `split`."""
        found = self._rows.user(user)
        assert found is not None, f"user {user} was skipped as bad, so it has no held-out item"
        return int(found[1][-2 if split == "valid" else -1])

    def eval_sample(self, user: int, split: str) -> RetrievalSample | None:
        """`user`'s evaluation sample of `split` (`SequencesDataset.eval_sample`), None below 3
        items or for a bad row skipped (`data.on_bad_row=skip`)."""
        found = self._rows.user(user)
        if found is None:
            return None
        _, seq, stamps = found
        if len(seq) < 3:
            return None
        end = len(seq) - (2 if split == "valid" else 1)
        negatives = unseen_items(
            self.seed, EVAL, 0, [user], [self.eval_negatives], seq, [0], [len(seq)], self.num_items
        ).tolist()
        return RetrievalSample(
            user,
            seq[:end][-self.max_seq_len :].tolist(),
            stamps[:end][-self.max_seq_len :].tolist(),
            [],
            [],
            [int(seq[end]), *negatives],
            int(stamps[end]),
        )

    def split(self, name: str, batch_size: int) -> _EvalSplit:
        """This rank's users of split `name`, padded to the same number of batches on every rank."""
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        per_rank = -(-self.num_users // self.world_size)
        batches = max(1, -(-per_rank // batch_size))
        first = min(self.rank * per_rank, self.num_users)
        stop = min(first + per_rank, self.num_users)
        return _EvalSplit(self, name, first, stop, batches * batch_size)


class _EvalSplit(Dataset[RetrievalSample]):
    """Evaluation samples of one split for one rank; users below 3 items and indices past the
    rank's users are padding (sample id -1, not scored)."""

    def __init__(self, source: ParquetSequences, name: str, first: int, stop: int, size: int) -> None:
        self.source, self.name, self.first, self.stop, self.size = source, name, first, stop, size
        catalog = source.num_items if source.full_eval else 0
        self.collate = partial(collate_retrieval, catalog_size=catalog)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> RetrievalSample:
        user = self.first + index
        sample = self.source.eval_sample(user, self.name) if user < self.stop else None
        if sample is not None:
            return sample
        # padding: the rank's first user's sample (as data=sequences pads), or a stand-in
        sample = self.source.eval_sample(self.first, self.name) if self.first < self.stop else None
        if sample is None:
            return RetrievalSample(-1, [0], [0], [], [], list(range(self.source.eval_negatives + 1)))
        sample.sample_id = -1
        return sample


class ItemStats:
    """The item vocabulary of sequence files (read with the first file's schema) and the check of
    each row group's item statistics against it: an item id below or above every id it holds
    (or outside `[0, data.num_items)` without one) is refused before the start."""

    def __init__(self, num_items: int | None) -> None:
        self.configured = num_items
        self.vocab: np.ndarray | None = None
        self.num_items = 0

    def read(self, files: ParquetFiles) -> None:
        self.vocab, self.num_items = _item_vocab(files, self.configured)

    def check(self, files: ParquetFiles, file: int, group: int, st: RowGroupStats | None, column: str) -> None:
        if st is None or not isinstance(st.min, int) or not isinstance(st.max, int):
            return
        low, high = (0, self.num_items - 1) if self.vocab is None else (int(self.vocab[0]), int(self.vocab[-1]))
        outside = st.min if st.min < low else st.max if st.max > high else None
        if outside is not None:
            where = files.where(file, group, column)
            message = (
                f"item id {outside} outside [0, data.num_items={self.num_items})"
                if self.vocab is None
                else f"item id {outside} is not in the stored vocabulary ({ITEM_VOCAB_KEY.decode()})"
            )
            raise DataFileError(files.key, where, f"{message} (its statistics)")


def _item_vocab(files: ParquetFiles, num_items: int | None) -> tuple[np.ndarray | None, int]:
    stored = files.metadata.get(ITEM_VOCAB_KEY)
    if stored is not None:
        vocab = np.frombuffer(stored, dtype="<i8").astype(np.int64)
        if len(vocab) < 2 or not bool(np.all(vocab[1:] > vocab[:-1])):
            raise DataFileError(
                files.key, files.where(0), f"{ITEM_VOCAB_KEY.decode()} is not a sorted list of distinct item ids"
            )
        return vocab, len(vocab)
    if num_items is None:
        raise DataFileError(
            files.key,
            files.where(0),
            f"no item vocabulary ({ITEM_VOCAB_KEY.decode()} in the key-value metadata, written by `recsys-data convert "
            "sequences`); set data.num_items to use the item ids as dense ids in [0, num_items)",
        )
    return None, num_items


def check_sequence_columns(files: ParquetFiles, columns: SequenceColumns) -> str | None:
    """Check the user, item and timestamp columns of the first file's schema (a `DataFileError`
    naming the file and column); returns the timestamp column to read (None: the default name
    is absent, so positions stand in for time)."""
    schema = files.schema

    def require(name: str, list_column: bool) -> None:
        i = schema.get_field_index(name)
        if i < 0:
            raise DataFileError(
                files.key, files.where(0), f"no column {name!r} (data.columns names it); it has {schema.names}"
            )
        t = schema.field(i).type
        ok = _list_type(t) and pa.types.is_integer(t.value_type) if list_column else pa.types.is_integer(t)
        if not ok:
            want = "a list of integers" if list_column else "an integer"
            raise DataFileError(files.key, files.where(0, column=name), f"must be {want}, it is {t}")

    found = Collected()  # every missing or wrong column in one run
    for name, is_list in ((columns.user, False), (columns.items, True)):
        with found:
            require(name, is_list)
    stamps = columns.timestamps
    if stamps is not None and schema.get_field_index(stamps) < 0 and stamps == SequenceColumns().timestamps:
        stamps = None  # the default name, absent: positions stand in for time
    elif stamps is not None:
        with found:
            require(stamps, True)
    found.raise_all()
    return stamps


def parquet_sequences_dataset(cfg: ParquetSequencesDataConfig, rank: int, world_size: int) -> ParquetSequences:
    """Builder of `data=parquet_sequences` for next-item retrieval: this rank's users, checked
    from the files' metadata (HSTU ranking: `recsys_pipe.data.parquet.ranking`)."""
    cfg = cfg.as_kind(SequencesDataConfig)  # type: ignore[assignment]
    c = cfg.columns
    stamps = c.timestamps
    items = ItemStats(cfg.num_items)

    def check_schema(files: ParquetFiles) -> None:
        nonlocal stamps
        found = Collected()
        if WINDOWS_KEY in files.metadata:
            raise DataFileError(
                files.key,
                files.where(0),
                f"its rows are windows of ratings for HSTU ranking ({WINDOWS_KEY.decode()}), not one row per user: "
                "a retrieval model reads users (convert without --windows)",
            )
        with found:
            stamps = check_sequence_columns(files, c)
        with found:
            items.read(files)
        found.raise_all()

    def check_stats(files: ParquetFiles, file: int, group: int, stats: dict[str, RowGroupStats]) -> None:
        if c.user in stats and stats[c.user].null_count:
            raise DataFileError(
                files.key, files.where(file, group, c.user), f"{stats[c.user].null_count} null user id(s)"
            )
        items.check(files, file, group, stats.get(c.items), c.items)

    stats = None if cfg.on_bad_row == "skip" else check_stats  # skipped as decoded, then
    files = open_parquet(cfg.path, "data.path", check_schema, stats, stats_columns=[c.user, c.items])
    vocab, num_items = items.vocab, items.num_items
    if cfg.eval_negatives > num_items - 1:
        raise ConfigError(
            ConfigProblem(
                "data.eval_negatives", f"{cfg.eval_negatives} exceeds the {num_items - 1} other items of the data"
            )
        )
    decoder = _SequenceDecoder(cfg, vocab, num_items, stamps, cfg.negatives_per_target, names=files)
    return ParquetSequences(files, decoder, rank, world_size, cfg)
