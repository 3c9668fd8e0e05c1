"""The sequence decoder both Parquet sequence sources share: `data=parquet_sequences` for
next-item retrieval (`recsys_pipe.data.parquet.sequences`) and its HSTU ranking windows
(`recsys_pipe.data.parquet.ranking`).

`SequenceDecoder` turns a window's table of sequence Parquet (one row per user: user id, item-id
list, optional timestamp list) into `UserRows`: dense item ids (through the item vocabulary the
converter stores, `ITEM_VOCAB_KEY`), checked, kept for the window's next part. Retrieval training
turns those into `TrainRows` (`UserRows.finish`); the ranking source reads the rows themselves.
The column checks of the files' schema (`check_sequence_columns`) and the vocabulary
(`item_vocab`) are shared too.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field, StrictStr

from recsys_pipe.config import ConfigError, ConfigProblem, Section
from recsys_pipe.data.batch import RETRIEVAL_KEYS, RetrievalBatch
from recsys_pipe.data.ids import ManagedColumn, SequenceIds
from recsys_pipe.data.jagged import concat_ranges, offsets_of
from recsys_pipe.data.negatives import TRAIN, unseen_items
from recsys_pipe.data.parquet.checks import RowProblems, list_column, null_rows
from recsys_pipe.data.parquet.files import Collected, DataFileError, ParquetFiles, RowGroupStats
from recsys_pipe.data.parquet.stream import Alloc, Fail, ReusedArrays, shared_empty
from recsys_pipe.data.serving import id_record

__all__ = [
    "ITEM_NAMES_KEY",
    "ITEM_VOCAB_KEY",
    "RATING_SCALE_KEY",
    "USER_NAMES_KEY",
    "WINDOWS_KEY",
    "DecodedColumns",
    "ItemStats",
    "SequenceColumns",
    "SequenceDecoder",
    "TrainRows",
    "UserRows",
    "check_sequence_columns",
    "is_list_type",
    "item_vocab",
    "item_vocab_metadata",
    "list_chunks",
    "names_metadata",
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


def is_list_type(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


@dataclass
class UserRows:
    """Decoded users: some rows of a window's decoded columns (`window`: dense item ids and
    timestamps, flat, with their offsets; user and sample ids), those of `order` in that order
    (None: all, as they lie). Row `i`'s items are `window.items[starts[i]:starts[i] + lengths[i]]`:
    training reads them there (`finish`), without gathering the rows' items first; `items`,
    `stamps` and `offsets` are the rows' own, gathered when first read (HSTU ranking, evaluation).
    Without a timestamp column the positions in each sequence stand in for time."""

    window: DecodedColumns
    order: np.ndarray | None
    source: SequenceDecoder
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
        if d.catalogue is not None:  # data.ids=managed: raw ids, drawn by dense id
            for ids in (inputs, targets, negatives):
                ids.numpy()[:] = d.catalogue[ids.numpy()]
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
class DecodedColumns:
    """A table's rows as numpy: dense item ids (flat) and their offsets, user ids, timestamps
    (flat; None: positions stand in) and the rows' sample ids."""

    items: np.ndarray
    offsets: np.ndarray
    users: np.ndarray
    stamps: np.ndarray | None
    sample_ids: np.ndarray


class SequenceDecoder:
    """Turns a row group of sequence Parquet into `UserRows` (dense item ids). A `BlockDecoder`:
    the training rows its rows become (`UserRows.finish`) are allocated with the `alloc` given.

    A window's decoded columns are kept for its next part and live in arrays reused by the next
    window (a window of 65,536 length-200 users maps 105 MB of item ids: fresh memory would
    page-fault every window). So rows it returned are valid until it decodes another table: a
    user that keeps rows (`_Rows`) has a decoder of its own (`copy`)."""

    def __init__(
        self,
        cfg: Any,
        vocab: np.ndarray | None,
        num_items: int,
        stamps: str | None,
        negatives_per_target: int = 1,
        names: ParquetFiles | None = None,
        raw_ids: ManagedColumn | None = None,
        catalogue: np.ndarray | None = None,
    ):
        c = cfg.columns
        #: the texts of ids a converter numbered (`names_metadata`), read from `names`' metadata
        self.item_names = None if names is None else stored_names(names, ITEM_NAMES_KEY)
        self.user_names = None if names is None else stored_names(names, USER_NAMES_KEY)
        #: HSTU ranking with `data.ids=managed`: how the item column gives raw ids, passed on to
        #: the managed table as they are (`ItemStats.raw_ids`)
        self.raw_ids = raw_ids
        #: retrieval with `data.ids=managed`: the raw id of each dense item id; the training rows
        #: are drawn by dense id and written as raw ids (`UserRows.finish`)
        self.catalogue = catalogue
        #: with a catalogue: the managed item table's rows and raw id space (`items_record`)
        self.managed_table = (
            (cfg.table_rows(num_items, "item"), cfg.managed.input_hash_size) if catalogue is not None else None
        )
        self.user, self.items, self.stamps = c.user, c.items, stamps
        self.columns = [c.user, c.items] + ([stamps] if stamps else [])
        self.vocab, self.num_items = (vocab if self.raw_ids is None else None), num_items
        self.max_seq_len, self.seed = cfg.max_seq_len, cfg.seed
        #: training negatives per target (retrieval; the HSTU ranking decoder draws none)
        self.negatives_per_target = negatives_per_target
        #: the most bytes of a training row (`UserRows.finish`): inputs, targets, timestamps and
        #: negatives of at most `max_seq_len` transitions, its offset, sample id and target time
        self.row_bytes = 8 * ((3 + negatives_per_target) * int(self.max_seq_len) + 4)
        #: raw id -> dense id (-1: unknown) when the raw ids are small enough for a table
        self._lookup: np.ndarray | None = None if self.raw_ids is None else self.raw_ids.hashed
        if self.vocab is not None and vocab[0] >= 0 and vocab[-1] < max(_LOOKUP_ROWS, 4 * len(vocab)):
            self._lookup = np.full(int(vocab[-1]) + 1, -1, dtype=np.int64)
            self._lookup[vocab] = np.arange(len(vocab))
        self._cached: DecodedColumns | None = None
        self._arrays = ReusedArrays()

    def items_record(self) -> dict[str, Any]:
        """How raw item ids become table rows (`features.json`): the vocabulary (of texts, where a
        converter numbered text ids), or the ids as they are."""
        if self.raw_ids is not None:
            return id_record("managed", self.num_items, input_hash_size=self.raw_ids.input_hash_size)
        if self.catalogue is not None:  # retrieval: the items the table scores, as the files hold them
            values = np.arange(self.num_items) if self.vocab is None else self.vocab
            names = self.item_names
            catalogue = values if names is None else [names[i] for i in values]
            rows, space = self.managed_table  # type: ignore[misc]
            return id_record("managed", rows, catalogue, space)
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
        """The raw item ids the decoder cannot map: not in the vocabulary, or outside [0, num_items)
        (`data.ids=managed`: outside the raw id space, `ManagedColumn.unknown`)."""
        if self.raw_ids is not None:
            return self.raw_ids.unknown(raw)
        if self.vocab is None:
            return (raw < 0) | (raw >= self.num_items)
        place = np.minimum(np.searchsorted(self.vocab, raw), len(self.vocab) - 1)
        return self.vocab[place] != raw

    def _unknown_message(self, raw: int) -> str:
        if self.raw_ids is not None:
            return self.raw_ids.message(raw)
        if self.vocab is None:
            return f"item id {raw} outside [0, data.num_items={self.num_items})"
        return f"item id {raw} is not in the stored vocabulary ({ITEM_VOCAB_KEY.decode()})"

    def copy(self) -> SequenceDecoder:
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

    def _columns(self, table: pa.Table, sample_ids: np.ndarray, fail: Fail) -> DecodedColumns:
        """The table's columns as numpy, checked; kept for the next call on the same rows (the
        parts of one window are decoded from the window's table in turn)."""
        cached = self._cached
        if cached is not None and np.array_equal(cached.sample_ids, sample_ids):
            return cached
        self._cached = None  # release the previous window before decoding this one
        users = _one(table, self.user, fail)
        if users.null_count:
            raise fail(self.user, f"{users.null_count} null user id(s)")
        raw, offsets = list_chunks(table.column(self.items), fail, self.items, "item ids")
        items = self._dense(raw, offsets, fail)
        stamps = None
        if self.stamps is not None:
            stamp_chunks, st_offsets = list_chunks(table.column(self.stamps), fail, self.stamps, "timestamps")
            if not np.array_equal(st_offsets, offsets):
                raise fail(self.stamps, f"lists of other lengths than {self.items!r}")
            stamps = self._joined("stamps", stamp_chunks)
        user_ids = users.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        self._cached = DecodedColumns(items, offsets, user_ids, stamps, sample_ids)
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
        straight into its place (no joined copy of the raw ids). With `data.ids=managed` the ids
        stay raw ids (`ManagedColumn`): checked, texts a converter numbered hashed."""
        if self.vocab is None and self._lookup is None and len(chunks) == 1:
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
        if self.vocab is None and self._lookup is None:
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
        """Dense ids as they are (no vocabulary): in `[0, num_items)`; raw ids of a managed
        table (`data.ids=managed`): in `[0, input_hash_size)`."""
        bound = self.num_items if self.raw_ids is None else self.raw_ids.input_hash_size
        if raw.size and (raw.min() < 0 or raw.max() >= bound):
            bad, row = _first_bad(raw, (raw < 0) | (raw >= bound), at, offsets)
            raise fail(self.items, self._unknown_message(bad), row)


def _first_bad(raw: np.ndarray, bad: np.ndarray, at: int, offsets: np.ndarray) -> tuple[int, int]:
    """The first bad id of `raw` (the window's ids from position `at` on) and its user's row."""
    i = int(np.flatnonzero(bad)[0])
    return int(raw[i]), int(np.searchsorted(offsets, at + i, side="right")) - 1


def _one(table: pa.Table, name: str, fail: Fail) -> pa.Array:
    col = table.column(name)
    return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)


def list_chunks(column: pa.ChunkedArray, fail: Fail, name: str, what: str) -> tuple[list[np.ndarray], np.ndarray]:
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


def item_vocab(files: ParquetFiles, num_items: int | None) -> tuple[np.ndarray | None, int]:
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
        ok = is_list_type(t) and pa.types.is_integer(t.value_type) if list_column else pa.types.is_integer(t)
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


class ItemStats:
    """The item vocabulary of sequence files (read with the first file's schema) and the check of
    each row group's item statistics against it: an item id below or above every id it holds
    (or outside `[0, data.num_items)` without one) is refused before the start.

    With `data.ids=managed` (`ids`) the ids are raw ids for a managed table: `vocab` is None, the
    item table has `data.item_rows` rows (or as many as the stored vocabulary, or
    `data.num_items`), and the statistics are checked against the raw id space (`ManagedColumn`;
    texts a converter numbered against their count)."""

    def __init__(self, num_items: int | None, ids: SequenceIds | None = None) -> None:
        self.configured = num_items
        self.ids = ids if ids is not None and ids.ids == "managed" else None
        self.vocab: np.ndarray | None = None
        self.num_items = 0
        self.raw_ids: ManagedColumn | None = None

    def read(self, files: ParquetFiles) -> None:
        if self.ids is None:
            self.vocab, self.num_items = item_vocab(files, self.configured)
            return
        self.raw_ids = self.ids.managed_column(stored_names(files, ITEM_NAMES_KEY), "item")
        stored = len(item_vocab(files, None)[0]) if ITEM_VOCAB_KEY in files.metadata else self.configured  # type: ignore[arg-type]
        rows = self.ids.table_rows(stored or 0, "item")
        if rows < 2:
            raise ConfigError(
                ConfigProblem(
                    "data.item_rows",
                    "data.ids=managed needs the item table's rows: the files store no item vocabulary "
                    f"({ITEM_VOCAB_KEY.decode()}) to size it by and data.num_items is null",
                )
            )
        self.num_items = rows

    def check(self, files: ParquetFiles, file: int, group: int, st: RowGroupStats | None, column: str) -> None:
        if st is None or not isinstance(st.min, int) or not isinstance(st.max, int):
            return
        if self.raw_ids is not None:
            bad = self.raw_ids.unknown(np.array([st.min, st.max], dtype=np.int64))
            outside, message = (st.min if bad[0] else st.max if bad[1] else None), self.raw_ids.message
        else:
            low, high = (0, self.num_items - 1) if self.vocab is None else (int(self.vocab[0]), int(self.vocab[-1]))
            outside, message = (st.min if st.min < low else st.max if st.max > high else None), self._message
        if outside is not None:
            where = files.where(file, group, column)
            raise DataFileError(files.key, where, f"{message(outside)} (its statistics)")

    def _message(self, outside: int) -> str:
        if self.vocab is None:
            return f"item id {outside} outside [0, data.num_items={self.num_items})"
        return f"item id {outside} is not in the stored vocabulary ({ITEM_VOCAB_KEY.decode()})"
