"""`data=parquet_sequences` for HSTU ranking: windows of user interactions streamed from Parquet,
with `data=movielens`'s keys, samples and labels (`model=hstu_small`).

A model that trains on `Sample` sources (`SequenceDataConfig`, its `ModelConfig.data_kind`) gets
`data=parquet_sequences` as a `ParquetRankingDataConfig` (`ParquetSequencesDataConfig.as_kind`);
next-item retrieval models get the same files as users (`recsys_pipe.data.parquet.sequences`).

**One row is one sample.** A row holds `user_id` (int), `item_ids` (list of int, chronological),
optionally `timestamps` (list of int, the same lengths; absent: the positions in the row stand
in for time) and `actions` (list of numbers, the same lengths: each event's rating;
`data.columns.*` renames them). Its sample is its last `data.max_seq_len` events, of which the
last `data.num_candidates` are the ranking candidates. A history event's rating becomes its
action id, `round(2 * rating)` (halves to even, as Python's `round`); a candidate's action id is
`MASKED_ACTION`, and its rating gives its labels: task `k` is `rating >= data.thresholds[k]`.
So the batches per epoch follow from the row counts in the footers, as the streaming machinery
needs (`recsys_pipe.data.parquet.stream`).

**Why rows are windows, not users.** `data=movielens` cuts each user's ratings, from the most
recent end, into windows of at most `max_seq_len`, dropping a window with no history; how many
windows a user has depends on the length of its list, which the footers do not hold. Counting
them would need a pass over every list before the first step, and ranks could not agree on
their batches from the metadata alone. So `recsys-data convert sequences --windows L` writes
one row per window, in `data=movielens`'s order (users in sorted raw-id order, each user's
windows oldest first), and records its cut in the key-value metadata `recsys-pipe/windows`
(`{"max_seq_len": L, "num_candidates": C}`). A null `data.max_seq_len` / `data.num_candidates`
takes the recorded values; other values are refused (they would cut other windows). The sorted
distinct raw user ids travel as `recsys-pipe/users` (little-endian int64, as the items'
vocabulary `recsys-pipe/items`), for `data.use_user_feature`: a user's dense id is its place in
it, as `data=movielens` numbers users. With `data.shuffle=false` the converted file trains
bitwise `data=movielens`'s losses on the same ratings.

Rows written by other tools need no metadata: each row is one sample as above (a file with one
row per user trains on each user's most recent window). A row with no more events than
`data.num_candidates`, a rating whose action id falls outside `[0, 10]`, null ratings and lists
of other lengths stop the run in one line naming the file, row group and column (before the
first step where the row group's statistics show a rating out of range).

With `data.ids=managed` (docs/raw-ids.md) items and users are the raw ids the file holds (text
ids a converter numbered: their texts' FNV-1a into the raw id space), checked against
`data.managed.input_hash_size` (statistics before the start, else the row), for managed tables of
`data.item_rows` / `data.user_rows` rows (null: the stored vocabularies' sizes).

The windows of an epoch are handed out in parts (`PartedStreamSource`, as for the retrieval
users): a worker decodes a window's columns once and turns one part of its rows at a time into
samples, so the first batch waits for one part, not the whole window.

Evaluation holds out the tail of the rows (`trainer.eval_batches` batches per rank), as
`data=movielens` holds out the tail of each rank's share.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import StrictStr, model_validator

from recsys_pipe.config import ConfigError, ConfigProblem, builder_field
from recsys_pipe.data.batch import ACTION_KEY, ITEM_KEY, MASKED_ACTION, USER_KEY, DataSpec, SequenceBatch
from recsys_pipe.data.ids import ManagedColumn
from recsys_pipe.data.in_memory.movielens import NUM_ACTIONS
from recsys_pipe.data.jagged import concat_ranges, offsets_of
from recsys_pipe.data.parquet.checks import RowProblems, list_column
from recsys_pipe.data.parquet.decode import (
    RATING_SCALE_KEY,
    USER_NAMES_KEY,
    WINDOWS_KEY,
    ItemStats,
    SequenceDecoder,
    check_sequence_columns,
    is_list_type,
    list_chunks,
    stored_names,
)
from recsys_pipe.data.parquet.files import Collected, DataFileError, ParquetFiles, RowGroupStats, open_parquet
from recsys_pipe.data.parquet.sequences import ParquetSequenceKeys, PartedStreamSource
from recsys_pipe.data.parquet.stream import Fail
from recsys_pipe.data.serving import RATING_ACTIONS, id_record, sequence_features
from recsys_pipe.data.source import SequenceDataConfig

__all__ = [
    "USER_VOCAB_KEY",
    "WINDOWS_KEY",
    "ParquetRankingDataConfig",
    "WindowRows",
    "parquet_ranking_dataset",
    "user_vocab_metadata",
    "windows_metadata",
]

USER_VOCAB_KEY = b"recsys-pipe/users"


def user_vocab_metadata(raw_users: np.ndarray) -> dict[bytes, bytes]:
    """The key-value metadata that carries a file's user vocabulary (its sorted distinct raw user ids)."""
    vocab = np.unique(np.asarray(raw_users, dtype=np.int64))
    return {USER_VOCAB_KEY: vocab.astype("<i8").tobytes()}


def windows_metadata(max_seq_len: int, num_candidates: int) -> dict[bytes, bytes]:
    """The key-value metadata that records how a converter cut the rows into windows."""
    return {WINDOWS_KEY: json.dumps({"max_seq_len": max_seq_len, "num_candidates": num_candidates}).encode()}


def _stored_windows(files: ParquetFiles) -> tuple[int, int] | None:
    """(max_seq_len, num_candidates) the files were cut with, or None when not recorded."""
    raw = files.metadata.get(WINDOWS_KEY)
    if raw is None:
        return None
    try:
        stored = json.loads(raw)
        cut = int(stored["max_seq_len"]), int(stored["num_candidates"])
    except (ValueError, KeyError, TypeError):
        raise DataFileError(files.key, files.where(0), f"{WINDOWS_KEY.decode()} is not the window cut") from None
    return cut


class ParquetRankingDataConfig(ParquetSequenceKeys, SequenceDataConfig):
    """`data=parquet_sequences` as HSTU ranking reads it (what `ParquetSequencesDataConfig.as_kind`
    makes for a model whose `data_kind` is `SequenceDataConfig`): windows with candidates and
    labels. A null `max_seq_len` or `num_candidates` is read from the files' recorded cut."""

    SIZE_KEY: ClassVar[str] = "data.path"

    name: Literal["parquet_sequences"] = "parquet_sequences"  # type: ignore[assignment]
    builder: StrictStr | None = builder_field("recsys_pipe.data.parquet.ranking:parquet_ranking_dataset")

    @model_validator(mode="after")
    def _cut_from_the_files(self) -> ParquetRankingDataConfig:
        if self.max_seq_len is not None and self.num_candidates is not None:
            return self
        cut = _stored_windows(open_parquet(self.path, "data.path"))
        if cut is None:  # every key missing, and what else the files lack, in one run
            problems = [
                ConfigProblem(
                    key,
                    f"HSTU ranking needs it: the files record no window cut ({WINDOWS_KEY.decode()}, written by "
                    "`recsys-data convert sequences --windows`)",
                )
                for key, value in (("data.max_seq_len", self.max_seq_len), ("data.num_candidates", self.num_candidates))
                if value is None
            ]
            try:
                columns, items = self.columns, ItemStats(self.num_items, self)
                open_parquet(self.path, "data.path", lambda files: _check_window_columns(files, columns, items))
            except ConfigError as exc:
                problems += exc.problems
            raise ConfigError(problems)
        # set without validating the assignment again (that would run this validator again)
        self.__dict__["max_seq_len"] = self.max_seq_len or cut[0]
        self.__dict__["num_candidates"] = self.num_candidates or cut[1]
        if self.num_candidates >= self.max_seq_len:  # type: ignore[operator]
            raise ConfigError(
                ConfigProblem(
                    "data.num_candidates",
                    f"{self.num_candidates} must be < data.max_seq_len ({self.max_seq_len}): a sample needs at least "
                    "one history token",
                )
            )
        return self


@dataclass
class WindowRows:
    """Decoded samples (tensors): items, action ids and timestamps of each sample's events
    (jagged, one offsets array, candidates last), the candidates' labels (`num_candidates` rows
    per sample), the dense user ids (empty without the user feature) and the sample ids."""

    items: torch.Tensor
    actions: torch.Tensor
    stamps: torch.Tensor
    offsets: torch.Tensor
    labels: torch.Tensor
    users: torch.Tensor | None
    sample_ids: torch.Tensor
    num_candidates: int

    def __len__(self) -> int:
        return int(self.sample_ids.numel())

    def slice(self, start: int, stop: int) -> WindowRows:
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        c = self.num_candidates
        return WindowRows(
            self.items[lo:hi],
            self.actions[lo:hi],
            self.stamps[lo:hi],
            self.offsets[start : stop + 1] - lo,
            self.labels[start * c : stop * c],
            None if self.users is None else self.users[start:stop],
            self.sample_ids[start:stop],
            c,
        )

    @classmethod
    def concat(cls, parts: Sequence[WindowRows]) -> WindowRows:
        lengths = torch.cat([p.offsets[1:] - p.offsets[:-1] for p in parts])
        users = [p.users for p in parts]
        return WindowRows(
            torch.cat([p.items for p in parts]),
            torch.cat([p.actions for p in parts]),
            torch.cat([p.stamps for p in parts]),
            torch.from_numpy(offsets_of(lengths.numpy())),
            torch.cat([p.labels for p in parts]),
            None if users[0] is None else torch.cat(users),  # type: ignore[arg-type]
            torch.cat([p.sample_ids for p in parts]),
            parts[0].num_candidates,
        )

    def batch(self) -> SequenceBatch:
        """The batch `recsys_pipe.data.batch.collate` makes of these samples."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        b = len(self)
        lengths = (self.offsets[1:] - self.offsets[:-1]).to(torch.int32)
        keys, values, all_lengths = [ITEM_KEY, ACTION_KEY], [self.items, self.actions], [lengths, lengths]
        if self.users is not None:
            keys.append(USER_KEY)
            values.append(self.users)
            all_lengths.append(torch.ones(b, dtype=torch.int32))
        kjt = KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(all_lengths))
        return SequenceBatch(
            sparse_features=kjt,
            timestamps=self.stamps,
            num_candidates=torch.full((b,), self.num_candidates, dtype=torch.int64),
            labels=self.labels,
            sample_ids=self.sample_ids,
        )


@dataclass
class _UserIds:
    """How the user column becomes the user feature's ids (`data.use_user_feature`): a user's
    place in the stored user vocabulary, or with `data.ids=managed` its raw id for the managed
    user table (`raw`, a `ManagedColumn`), of `rows` rows."""

    vocab: np.ndarray | None
    raw: ManagedColumn | None
    rows: int

    def unknown(self, users: np.ndarray) -> np.ndarray:
        """Which of the column's `users` it cannot read."""
        if self.raw is not None:
            return self.raw.unknown(users)
        vocab = self.vocab
        assert vocab is not None
        place = np.minimum(np.searchsorted(vocab, users), len(vocab) - 1)
        return vocab[place] != users

    def message(self, user: int) -> str:
        return self.raw.message(user) if self.raw is not None else _unknown_user(user)

    def __call__(self, users: np.ndarray) -> np.ndarray:
        """The ids of `users` (checked with `unknown`): dense ids, or raw ids (`data.ids=managed`)."""
        if self.raw is not None:
            return np.array(self.raw.raw_ids(users), dtype=np.int64)  # its own (the column's may be Arrow's)
        return np.searchsorted(self.vocab, users).astype(np.int64)  # type: ignore[arg-type]

    def record(self, names: list[str] | None) -> dict[str, Any]:
        """How a raw user id becomes its row (`features.json`)."""
        if self.raw is not None:
            return id_record("managed", self.rows, input_hash_size=self.raw.input_hash_size)
        return id_record("vocabulary", self.rows, self.vocab if names is None else names)


class _WindowDecoder:
    """Turns a window's table of sequence Parquet into `WindowRows`, one part of the window at a
    time (`PartedStreamSource`): the items, timestamps and user ids through
    `data=parquet_sequences`' own decoder (dense ids, its checks, the window's columns kept for
    its next part), the ratings here (kept alike)."""

    def __init__(
        self,
        cfg: ParquetRankingDataConfig,
        sequences: SequenceDecoder,
        actions: str,
        users: _UserIds | None,
        rating_scale: float = 5.0,
    ) -> None:
        self.sequences, self.actions, self.users = sequences, actions, users
        #: a rating's action id is `rint(factor * rating)`: 2 for MovieLens's five stars, in [0, 10] on any scale
        self.factor = action_factor(rating_scale)
        self.columns = [*sequences.columns, actions]
        self.max_seq_len, self.num_candidates = int(cfg.max_seq_len), int(cfg.num_candidates)  # type: ignore[arg-type]
        self.thresholds = np.asarray(cfg.thresholds, dtype=np.float64)
        #: the last window's sample ids, ratings (flat) and their offsets
        self._cached: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def validate(self, table: pa.Table) -> RowProblems:
        """Every row `__call__` would refuse, check by check (`recsys_pipe.data.parquet.checks`):
        the sequence decoder's, and the ratings', the candidates' and the users' own."""
        problems = self.sequences.validate(table)
        items, item_offsets, _ = list_column(table.column(self.sequences.items))
        ratings, offsets, null_lists = list_column(table.column(self.actions))
        problems.add(self.actions, null_lists, "a null list")
        problems.add(self.actions, (np.diff(offsets) != np.diff(item_offsets)) & ~null_lists, "lists of other lengths")
        nulls = np.asarray(ratings.is_null()) if ratings.null_count else np.zeros(len(ratings), dtype=bool)
        problems.add_values(self.actions, nulls, offsets, "a null rating")
        values = ratings.fill_null(0).to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
        action_ids = np.rint(self.factor * values)
        problems.add_values(
            self.actions,
            ~((action_ids >= 0) & (action_ids < NUM_ACTIONS)),
            offsets,
            lambda at: _rating(values[at], self.factor),
        )
        short = np.diff(item_offsets) <= self.num_candidates
        problems.add(
            self.sequences.items, short, lambda row: _short(int(np.diff(item_offsets)[row]), self.num_candidates)
        )
        users = self.users
        if users is not None:
            raw = table.column(self.sequences.user).fill_null(0).to_numpy().astype(np.int64)
            problems.add(self.sequences.user, users.unknown(raw), lambda row: users.message(int(raw[row])))
        return problems

    def serving_features(self) -> dict[str, Any]:
        """Items and users through the stored vocabularies, ratings as action ids (`recsys_pipe.data.serving`)."""
        seq = self.sequences
        items = seq.items_record()
        users = None if self.users is None else self.users.record(seq.user_names)
        columns = {"user": seq.user, "items": seq.items, "actions": self.actions}
        if seq.stamps is not None:
            columns["timestamps"] = seq.stamps
        actions = {**RATING_ACTIONS, "transform": {"kind": "scaled_round", "scale": self.factor}}
        return sequence_features(
            items, actions, seq.stamps is not None, self.max_seq_len, self.num_candidates, users, columns
        )

    def named_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """A row as read, its numbered ids as the texts they were (`SequenceDecoder.named_row`)."""
        return self.sequences.named_row(row)

    def __call__(self, table: pa.Table, sample_ids: np.ndarray, order: np.ndarray | None, fail: Fail) -> WindowRows:
        window_ratings, window_offsets = self._ratings(table, sample_ids, fail)
        rows = self.sequences(table, sample_ids, order, fail)  # only the rows of `order`, in its order
        if order is None:
            ratings, part_fail = window_ratings, fail
        else:
            starts = window_offsets[:-1][order]
            ratings = window_ratings[concat_ranges(starts, window_offsets[1:][order] - starts)]
            window_fail = fail

            def part_fail(column: str, message: str, row: int | None = None) -> DataFileError:
                return window_fail(column, message, None if row is None else int(order[row]))

        n = np.diff(rows.offsets)
        c, length = self.num_candidates, self.max_seq_len
        short = np.flatnonzero(n <= c)
        if len(short):
            row = int(short[0])
            raise part_fail(self.sequences.items, _short(int(n[row]), c), row)
        action_ids = np.rint(self.factor * ratings)  # halves to even, as Python's round(), which data=movielens uses
        bad = np.flatnonzero(~((action_ids >= 0) & (action_ids < NUM_ACTIONS)))
        if len(bad):
            at = int(bad[0])
            raise part_fail(self.actions, _rating(ratings[at], self.factor), _row_of(rows.offsets, at))
        users = self._users(rows.users, part_fail)
        keep = np.minimum(n, length)
        gather = concat_ranges(rows.offsets[:-1] + n - keep, keep)
        keep_at = offsets_of(keep)
        # candidates: the last c events of each sample
        within = np.arange(len(gather)) - np.repeat(keep_at[:-1], keep)
        candidate = within >= np.repeat(keep - c, keep)
        picked = ratings[gather]
        labels = (picked[candidate][:, None] >= self.thresholds[None, :]).astype(np.float32)
        actions = np.where(candidate, MASKED_ACTION, action_ids[gather]).astype(np.int64)
        return WindowRows(
            torch.from_numpy(rows.items[gather]),
            torch.from_numpy(actions),
            torch.from_numpy(rows.stamps[gather]),
            torch.from_numpy(keep_at),
            torch.from_numpy(labels),
            None if users is None else torch.from_numpy(users),
            torch.from_numpy(np.ascontiguousarray(rows.sample_ids)),
            c,
        )

    def _ratings(self, table: pa.Table, sample_ids: np.ndarray, fail: Fail) -> tuple[np.ndarray, np.ndarray]:
        """The window's ratings (flat, float64) and their offsets, checked (no nulls, the items'
        lengths); kept for the window's next part."""
        cached = self._cached
        if cached is not None and np.array_equal(cached[0], sample_ids):
            return cached[1], cached[2]
        self._cached = None  # release the previous window first
        values, offsets, at, first_row = [], [np.zeros(1, dtype=np.int64)], 0, 0
        for chunk in table.column(self.actions).chunks:
            if chunk.null_count:
                row = int(np.flatnonzero(chunk.is_null().to_numpy(zero_copy_only=False))[0])
                raise fail(self.actions, "a null list", first_row + row)
            bounds = np.asarray(chunk.offsets, dtype=np.int64)
            bounds = bounds - bounds[0]
            flat = chunk.flatten()
            if flat.null_count:
                event = int(np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0])
                raise fail(self.actions, "a null rating", first_row + _row_of(bounds, event))
            values.append(flat.to_numpy(zero_copy_only=False).astype(np.float64, copy=False))
            offsets.append(bounds[1:] + at)
            at += len(flat)
            first_row += len(chunk)
        ratings = values[0] if len(values) == 1 else np.concatenate(values)
        ratings_offsets = np.concatenate(offsets)
        item_offsets = list_chunks(table.column(self.sequences.items), fail, self.sequences.items, "item ids")[1]
        if not np.array_equal(ratings_offsets, item_offsets):
            row = int(np.flatnonzero(np.diff(ratings_offsets) != np.diff(item_offsets))[0])
            raise fail(self.actions, f"lists of other lengths than {self.sequences.items!r}", row)
        self._cached = (sample_ids, ratings, ratings_offsets)
        return ratings, ratings_offsets

    def _users(self, raw: np.ndarray, fail: Fail) -> np.ndarray | None:
        users = self.users
        if users is None:
            return None
        unknown = np.flatnonzero(users.unknown(raw))
        if len(unknown):
            row = int(unknown[0])
            raise fail(self.sequences.user, users.message(int(raw[row])), row)
        return users(raw)


def _check_window_columns(files: ParquetFiles, columns: Any, items: ItemStats) -> str | None:
    """Every missing or wrong column of windows, and a missing item vocabulary, in one
    ConfigError; returns the timestamp column to read (`check_sequence_columns`)."""
    found, stamps = Collected(), None
    with found:
        stamps = check_sequence_columns(files, columns)
    with found:
        items.read(files)
    with found:
        if columns.actions is None:
            raise ConfigError(ConfigProblem("data.columns.actions", "HSTU ranking needs the rating list column"))
        _check_actions(files, columns.actions)
    found.raise_all()
    return stamps


def _check_actions(files: ParquetFiles, actions: str) -> None:
    schema = files.schema
    i = schema.get_field_index(actions)
    if i < 0:
        raise DataFileError(
            files.key,
            files.where(0),
            f"no column {actions!r} (data.columns.actions names it: each event's rating, for HSTU ranking); it "
            f"has {schema.names}",
        )
    t = schema.field(i).type
    if not (is_list_type(t) and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type))):
        raise DataFileError(files.key, files.where(0, column=actions), f"must be a list of numbers, it is {t}")


def _short(events: int, num_candidates: int) -> str:
    return (
        f"a row of {events} event(s): a sample needs more than data.num_candidates={num_candidates} (history, then "
        "candidates)"
    )


def action_factor(rating_scale: float) -> float:
    """What a rating is multiplied by for its action id: `(NUM_ACTIONS - 1) / scale` (2.0 on 5 stars)."""
    return (NUM_ACTIONS - 1) / rating_scale


def _rating(rating: float, factor: float = 2.0) -> str:
    return f"rating {rating} gives the action id round({factor:g} * rating) outside [0, {NUM_ACTIONS - 1}]"


def _unknown_user(user: int) -> str:
    return f"user id {user} is not in the stored user vocabulary ({USER_VOCAB_KEY.decode()})"


def _row_of(offsets: np.ndarray, event: int) -> int:
    return int(np.searchsorted(offsets, event, side="right")) - 1


def rating_scale(files: ParquetFiles) -> float:
    """The scale of the files' ratings, `(0, scale]` (`RATING_SCALE_KEY`; absent: 5 stars)."""
    stored = files.metadata.get(RATING_SCALE_KEY)
    return float(stored) if stored is not None else 5.0


def _user_vocab(files: ParquetFiles) -> np.ndarray:
    stored = files.metadata.get(USER_VOCAB_KEY)
    if stored is None:
        raise DataFileError(
            files.key,
            files.where(0),
            f"data.use_user_feature needs a user vocabulary ({USER_VOCAB_KEY.decode()} in the key-value metadata, "
            "written by `recsys-data convert sequences --windows`)",
        )
    vocab = np.frombuffer(stored, dtype="<i8").astype(np.int64)
    if not len(vocab) or not bool(np.all(vocab[1:] > vocab[:-1])):
        raise DataFileError(
            files.key, files.where(0), f"{USER_VOCAB_KEY.decode()} is not a sorted list of distinct user ids"
        )
    return vocab


def _user_ids(cfg: ParquetRankingDataConfig, files: ParquetFiles) -> _UserIds:
    """The user feature's ids: through the stored user vocabulary, or with `data.ids=managed` as
    raw ids into a table of `data.user_rows` rows (null: as many as the stored vocabulary holds)."""
    raw = cfg.managed_column(stored_names(files, USER_NAMES_KEY), "user")
    if raw is None:
        vocab = _user_vocab(files)
        return _UserIds(vocab, None, len(vocab))
    stored = len(_user_vocab(files)) if USER_VOCAB_KEY in files.metadata else 0
    rows = cfg.table_rows(stored, "user")
    if rows < 2:
        raise ConfigError(
            ConfigProblem(
                "data.user_rows",
                "data.ids=managed with data.use_user_feature needs the user table's rows: the files store no user "
                f"vocabulary ({USER_VOCAB_KEY.decode()}) to size it by",
            )
        )
    return _UserIds(None, raw, rows)


def _check_user_stats(
    files: ParquetFiles, file: int, group: int, st: RowGroupStats | None, raw: ManagedColumn | None, column: str
) -> None:
    """A row group whose user statistics show a raw user id outside the space (`data.ids=managed`)."""
    if raw is None or st is None or not isinstance(st.min, int) or not isinstance(st.max, int):
        return
    bad = raw.unknown(np.array([st.min, st.max], dtype=np.int64))
    if bad.any():
        outside = st.min if bad[0] else st.max
        raise DataFileError(files.key, files.where(file, group, column), f"{raw.message(outside)} (its statistics)")


def parquet_ranking_dataset(cfg: ParquetRankingDataConfig, rank: int, world_size: int) -> PartedStreamSource:
    """Builder of `data=parquet_sequences` for HSTU ranking: this rank's windows, checked from the
    files' metadata (a missing or wrong-typed column, a rating out of range in the statistics, a
    window cut other than the keys)."""
    c = cfg.columns
    if c.actions is None:
        raise ConfigError(ConfigProblem("data.columns.actions", "HSTU ranking needs the rating list column"))
    actions: str = c.actions
    stamps: str | None = None
    items = ItemStats(cfg.num_items, cfg)

    factor = action_factor(5.0)
    user_raw: ManagedColumn | None = None  # data.ids=managed: the user ids' statistics are checked

    def check_schema(files: ParquetFiles) -> None:
        nonlocal stamps, factor, user_raw
        stamps = _check_window_columns(files, c, items)
        factor = action_factor(rating_scale(files))
        if cfg.use_user_feature:
            user_raw = cfg.managed_column(stored_names(files, USER_NAMES_KEY), "user")

    def check_stats(files: ParquetFiles, file: int, group: int, stats: dict[str, RowGroupStats]) -> None:
        if c.user in stats and stats[c.user].null_count:
            raise DataFileError(
                files.key, files.where(file, group, c.user), f"{stats[c.user].null_count} null user id(s)"
            )
        items.check(files, file, group, stats.get(c.items), c.items)
        _check_user_stats(files, file, group, stats.get(c.user), user_raw, c.user)
        st = stats.get(actions)
        for value in (st.min, st.max) if st is not None else ():
            if value is not None and not 0 <= round(factor * float(value)) < NUM_ACTIONS:
                raise DataFileError(files.key, files.where(file, group, actions), _rating(value, factor))

    stats = None if cfg.on_bad_row == "skip" else check_stats  # skipped as decoded, then
    files = open_parquet(cfg.path, "data.path", check_schema, stats, stats_columns=[c.user, c.items, actions])
    cut = _stored_windows(files)
    if cut is not None and cut != (cfg.max_seq_len, cfg.num_candidates):
        raise ConfigError(
            ConfigProblem(
                "data.max_seq_len" if cut[0] != cfg.max_seq_len else "data.num_candidates",
                f"{files.where(0)} holds windows cut with max_seq_len={cut[0]}, num_candidates={cut[1]} "
                f"(data.max_seq_len={cfg.max_seq_len}, data.num_candidates={cfg.num_candidates} would cut others): "
                "set those (or null), or convert again with other --windows / --num-candidates",
            )
        )
    vocab, num_items = items.vocab, items.num_items
    users = _user_ids(cfg, files) if cfg.use_user_feature else None
    vocab_sizes = {ITEM_KEY: num_items, ACTION_KEY: NUM_ACTIONS}
    rows_keys = {ITEM_KEY: "data.item_rows"}
    if users is not None:
        vocab_sizes[USER_KEY] = users.rows
        rows_keys[USER_KEY] = "data.user_rows"
    spec = DataSpec(num_tasks=len(cfg.thresholds), vocab_sizes=vocab_sizes, managed=cfg.managed_features(rows_keys))
    sequences = SequenceDecoder(cfg, vocab, num_items, stamps, names=files, raw_ids=items.raw_ids)  # type: ignore[arg-type]
    decoder = _WindowDecoder(cfg, sequences, actions, users, rating_scale(files))  # type: ignore[arg-type]
    return PartedStreamSource(files, decoder, rank, world_size, cfg, spec)
