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

With `data.ids=managed` (docs/raw-ids.md) the item table is a managed-collision table: samples
and negatives are drawn by dense id as above, and the training rows (`UserRows.finish`) and the
evaluation batches (`RawItemCollate`) carry each item's raw id, the vocabulary's (text ids: their
FNV-1a into the raw id space), so the catalogue is the vocabulary.

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

import ctypes
import os
from collections.abc import Sequence
from functools import partial
from typing import Any, ClassVar, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationInfo, field_validator
from torch.utils.data import Dataset, get_worker_info

from recsys_pipe.config import (
    ConfigError,
    ConfigProblem,
    builder_field,
    home_expanded,
    import_fn,
    validate_section,
)
from recsys_pipe.data.batch import RetrievalSample, collate_retrieval, raw_item_collate
from recsys_pipe.data.ids import SequenceIds
from recsys_pipe.data.in_memory.sequences import SequencesDataConfig
from recsys_pipe.data.negatives import EVAL, unseen_items
from recsys_pipe.data.parquet.decode import (
    ITEM_NAMES_KEY,
    ITEM_VOCAB_KEY,
    WINDOWS_KEY,
    ItemStats,
    SequenceColumns,
    SequenceDecoder,
    UserRows,
    check_sequence_columns,
    stored_names,
)
from recsys_pipe.data.parquet.files import Collected, DataFileError, ParquetFiles, RowGroupStats, open_parquet
from recsys_pipe.data.parquet.stream import EpochOrder, Piece, StreamSource, WindowDataset
from recsys_pipe.data.serving import SEQUENCE_COLUMNS, retrieval_features, retrieval_row
from recsys_pipe.data.source import SPLITS, DataConfig

__all__ = [
    "RETRIEVAL_MAX_SEQ_LEN",
    "ParquetSequenceKeys",
    "ParquetSequencesDataConfig",
    "PartedStreamSource",
    "parquet_sequences_dataset",
]

#: `data.max_seq_len` of next-item retrieval when it is null (as `data=sequences`)
RETRIEVAL_MAX_SEQ_LEN = 50


class ParquetSequenceKeys(SequenceIds):
    """The keys `data=parquet_sequences` has for both kinds of model: the files, their columns,
    the shuffle window, how item and user ids become rows (`SequenceIds`: `data.ids`,
    `data.managed`, `data.item_rows`, `data.user_rows`), and the sample shape of HSTU ranking
    (`recsys_pipe.data.parquet.ranking`).
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


class _Rows:
    """Random access to users by global position (evaluation, dumps), one row group cached.
    With `skip` (`data.on_bad_row=skip`), a bad user is None (evaluation padding)."""

    def __init__(self, files: ParquetFiles, decoder: SequenceDecoder, skip: bool = False) -> None:
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
            within = None if row is None else int(at[row])
            return DataFileError(files.key, files.where(file, group, column, within), message)

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
        self, files: ParquetFiles, order: EpochOrder, decoder: SequenceDecoder, window: int, skip: bool = False
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
    a window's decoded columns for the window's next part (`SequenceDecoder`)."""

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

    def __init__(self, files: ParquetFiles, decoder: SequenceDecoder, rank: int, world_size: int, cfg: Any) -> None:
        super().__init__(files, decoder, rank, world_size, cfg, cfg.retrieval_spec(decoder.num_items))
        self.num_items = decoder.num_items
        self.seed, self.max_seq_len = cfg.seed, cfg.max_seq_len
        self.eval_negatives, self.full_eval = cfg.eval_negatives, cfg.full_eval
        self.raw_items = decoder.vocab if decoder.vocab is not None else np.arange(decoder.num_items)
        self._rows = _Rows(files, decoder, skip=cfg.on_bad_row == "skip")
        self.raw_users = _RawUsers(self._rows)

    def prepare(self, eval_batches: int) -> None:
        super().prepare(0)  # evaluation is the leave-one-out splits, not held-out rows

    @property
    def catalogue(self) -> np.ndarray | None:
        """`data.ids=managed`: the raw id of each dense item id (what the batches carry)."""
        return self.decoder.catalogue  # type: ignore[attr-defined]

    def serving_features(self) -> dict[str, Any]:
        """Items through the stored vocabulary, or as dense ids (`recsys_pipe.data.serving`)."""
        decoder = self.decoder
        assert isinstance(decoder, SequenceDecoder)
        return retrieval_features(decoder.items_record(), decoder.stamps is not None, self.max_seq_len, self.columns)

    @property
    def columns(self) -> dict[str, str]:
        c = self.cfg.columns
        return {"user": c.user, "items": c.items, "timestamps": c.timestamps or SEQUENCE_COLUMNS["timestamps"]}

    def raw_rows(self, sample_ids: Sequence[int], split: str | None) -> list[dict[str, Any]]:
        """Each user's row (by global position) cut before its held-out item of `split`."""
        decoder = self.decoder
        assert isinstance(decoder, SequenceDecoder)
        rows = []
        for user in map(int, sample_ids):
            found = self._rows.user(user)
            assert found is not None  # a held-out sample is never a skipped row
            raw_user, seq, stamps = found
            named = raw_user if decoder.user_names is None else decoder.user_names[raw_user]
            raw = self.raw_items[seq].tolist()
            raw = raw if decoder.item_names is None else [decoder.item_names[i] for i in raw]
            rows.append(retrieval_row(named, raw, stamps.tolist(), split, decoder.stamps is not None, self.columns))
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
        self.collate = raw_item_collate(partial(collate_retrieval, catalog_size=catalog), source.catalogue)

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


def _catalogue(cfg: Any, files: ParquetFiles, vocab: np.ndarray | None, num_items: int) -> np.ndarray | None:
    """With `data.ids=managed`, the raw id of each dense item id: the stored vocabulary's ids (or
    `[0, data.num_items)`), texts a converter numbered hashed (`ManagedColumn`); refused in one
    line where an id lies outside the raw id space."""
    column = cfg.managed_column(stored_names(files, ITEM_NAMES_KEY), "item")
    if column is None:
        return None
    numbers = vocab if vocab is not None else np.arange(num_items, dtype=np.int64)
    bad = np.flatnonzero(column.unknown(numbers))
    if len(bad):
        where = f"{ITEM_VOCAB_KEY.decode()}" if vocab is not None else "data.num_items"
        raise DataFileError(files.key, files.where(0), f"{column.message(int(numbers[bad[0]]))} (of {where})")
    return column.raw_ids(numbers)


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
    catalogue = _catalogue(cfg, files, vocab, num_items)
    decoder = SequenceDecoder(cfg, vocab, num_items, stamps, cfg.negatives_per_target, names=files, catalogue=catalogue)
    return ParquetSequences(files, decoder, rank, world_size, cfg)
