"""Converters of the text formats to Parquet (`recsys-data convert ...`).

`convert_criteo`: Criteo TSV files (Kaggle `train.txt`, Terabyte `day_N`) -> one Parquet file per
input: `label` (int8), `int_0`..`int_12` (int64, raw, empty -> 0), `cat_0`..`cat_25` (int64, the
hexadecimal id as an integer, empty -> 0), row groups of `row_group_size` rows. The input streams
through in chunks of whole lines (`recsys_pipe.data.text.files`), parsed by pyarrow's CSV reader on
a pool of threads, so memory stays bounded whatever the file's size; a bad row stops the
conversion with the same `<file>:<line>: <problem>` line as `data=criteo` and leaves no output.

`convert_sequences`: a "user item" file (SASRec) or MovieLens ratings -> one Parquet file, one row
per user in sorted raw-id order: `user_id` (int64), `item_ids` (list<int64>, chronological),
`timestamps` (list<int64>, MovieLens only) and `actions` (list<double>: the ratings, MovieLens
only). Ids stay raw; the file's key-value metadata carries the sorted distinct item ids
(`recsys_pipe.data.parquet.sequences.item_vocab_metadata`), from which the reading source numbers
the items as `data=sequences` does. With `windows` (HSTU ranking), one row per window of a user's
ratings instead, cut as `data=movielens` cuts them (`recsys_pipe.data.parquet.ranking` says why).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.data.text.criteo_tsv import CATEGORICAL_KEYS, DENSE_NAMES, CriteoRows, parse_criteo_chunk
from recsys_pipe.data.text.criteo_tsv import LAYOUT as CRITEO_LAYOUT
from recsys_pipe.data.text.files import check_text_head, line_chunks, parallel_map
from recsys_pipe.data.text.interactions import CsvConfig

__all__ = ["ConvertedFile", "convert_criteo", "convert_sequences", "criteo_schema"]

#: rows per Parquet row group: the unit a streaming reader hands to a rank or a worker
ROW_GROUP_SIZE = 131_072


@dataclass(frozen=True)
class ConvertedFile:
    """One output of a conversion."""

    source: str
    path: str
    rows: int
    row_groups: int


def criteo_schema():  # -> pyarrow.Schema (pyarrow is imported on use)
    """The Parquet schema `convert_criteo` writes."""
    import pyarrow as pa

    fields = [pa.field("label", pa.int8(), nullable=False)]
    fields += [pa.field(name, pa.int64(), nullable=False) for name in (*DENSE_NAMES, *CATEGORICAL_KEYS)]
    return pa.schema(fields)


def _output_name(source: str) -> str:
    name = Path(source).name
    stem, suffix = os.path.splitext(name)
    return (stem if suffix.lower() in (".txt", ".tsv", ".csv", ".dat") else name) + ".parquet"


def _refuse(message: str, key: str = "SRC") -> ConfigError:
    return ConfigError(ConfigProblem(key, message))


def convert_criteo(
    sources: Sequence[str],
    destination: str,
    row_group_size: int = ROW_GROUP_SIZE,
    workers: int | None = None,
    overwrite: bool = False,
) -> list[ConvertedFile]:
    """Convert Criteo TSV files to Parquet, one output file per input, in `destination` (a
    directory, created if missing); outputs are named after their inputs (`day_0` ->
    `day_0.parquet`, `train.txt` -> `train.parquet`).

    Every input is checked (readable, text, not empty) before anything is written. A file is
    written under a hidden name and renamed when complete, so a failed conversion leaves no
    partial output. Raises ConfigError (one line naming the file and line) for bad input."""
    outputs = _plan_outputs(sources, destination, overwrite)
    for source in sources:
        check_text_head(source, CRITEO_LAYOUT)
    return [_convert_one_criteo(src, out, row_group_size, workers) for src, out in zip(sources, outputs)]


def _plan_outputs(sources: Sequence[str], destination: str, overwrite: bool) -> list[str]:
    if not sources:
        raise _refuse("no input files")
    for source in sources:
        if not os.path.isfile(source):
            raise _refuse(f"{source}: no such file")
    if os.path.exists(destination) and not os.path.isdir(destination):
        raise _refuse(f"{destination}: exists and is not a directory", "DST")
    outputs = [os.path.join(destination, _output_name(s)) for s in sources]
    seen: dict[str, str] = {}
    for source, out in zip(sources, outputs):
        if out in seen:
            raise _refuse(f"{seen[out]} and {source} would both be written to {out}; rename one")
        seen[out] = source
        if os.path.exists(out) and not overwrite:
            raise _refuse(f"{out} exists (--overwrite replaces it)", "DST")
    os.makedirs(destination, exist_ok=True)
    return outputs


def _criteo_table(rows: CriteoRows):  # -> pyarrow.Table
    import pyarrow as pa

    columns = [pa.array(rows.labels)]
    columns += [pa.array(rows.integers[j]) for j in range(len(DENSE_NAMES))]
    columns += [pa.array(rows.categorical[j]) for j in range(len(CATEGORICAL_KEYS))]
    return pa.Table.from_arrays(columns, schema=criteo_schema())


def _row_groups(tables: Iterator, size: int) -> Iterator:
    """Re-cut a stream of tables into tables of exactly `size` rows (the last one shorter)."""
    import pyarrow as pa

    held: list = []
    count = 0
    for table in tables:
        held.append(table)
        count += table.num_rows
        while count >= size:
            whole = pa.concat_tables(held)
            yield whole.slice(0, size)
            rest = whole.slice(size)
            held, count = ([rest] if rest.num_rows else []), rest.num_rows
    if count:
        yield pa.concat_tables(held)


def _convert_one_criteo(source: str, output: str, row_group_size: int, workers: int | None) -> ConvertedFile:
    import pyarrow.parquet as pq

    # one pass over the file: chunks end at line ends, so no count of the lines is needed first
    chunks = line_chunks(source, 0, os.path.getsize(source), 1)
    parsed = parallel_map(partial(_parse_to_table, source), chunks, workers)
    partial_path = os.path.join(os.path.dirname(output), f".{os.path.basename(output)}.partial")
    rows = groups = 0
    try:
        # no dictionary pages: ids and counts have too many values for them to pay (measured on a
        # generated 1M-row file: 2.4x the writing time and a 14 % larger file)
        with pq.ParquetWriter(partial_path, criteo_schema(), use_dictionary=False) as writer:
            for table in _row_groups(parsed, row_group_size):
                writer.write_table(table, row_group_size=row_group_size)
                rows += table.num_rows
                groups += 1
        os.replace(partial_path, output)
    finally:
        if os.path.exists(partial_path):
            os.remove(partial_path)
    return ConvertedFile(source, output, rows, groups)


def _parse_to_table(source: str, chunk):  # -> pyarrow.Table
    return _criteo_table(parse_criteo_chunk(source, chunk))


def sequence_schema(with_timestamps: bool, with_actions: bool):  # -> pyarrow.Schema
    """The Parquet schema `convert_sequences` writes."""
    import pyarrow as pa

    fields = [pa.field("user_id", pa.int64(), nullable=False), pa.field("item_ids", pa.list_(pa.int64()))]
    if with_timestamps:
        fields.append(pa.field("timestamps", pa.list_(pa.int64())))
    if with_actions:
        fields.append(pa.field("actions", pa.list_(pa.float64())))
    return pa.schema(fields)


def convert_sequences(
    source: str,
    destination: str,
    row_group_size: int = 16_384,
    overwrite: bool = False,
    csv: CsvConfig | None = None,
    windows: int | None = None,
    num_candidates: int = 4,
    rating_scale: float = 5.0,
) -> ConvertedFile:
    """Convert a "user item" file or MovieLens ratings to sequence Parquet in `destination` (a
    directory, created if missing), named after the input (`ratings.dat` -> `ratings.parquet`):
    one row per user, or with `windows` one row per window of at most `windows` ratings.

    The file is read as `data=sequences` reads it (`read_interactions`, with the same CSV keys
    `csv`: delimiter, header, columns), so the same lines are refused with the same errors. Grouping
    by user needs every line, so memory grows with the file (MovieLens 20M: about 2 GB).

    With `windows`, each user's events are cut as `data=movielens` cuts them for HSTU ranking:
    from the most recent end into windows of at most `windows` events, a window of no more than
    `num_candidates` events dropped; rows are the windows of the users in sorted raw-id order,
    each user's oldest first. The file needs ratings (they become the action ids and labels).
    The cut (`windows_metadata`) and the user vocabulary (`user_vocab_metadata`) go into the
    key-value metadata (`recsys_pipe.data.parquet.ranking`).

    Ids that are text (`u17`, `B00005N7P0`: detected from the file's first lines) are numbered in
    sorted order, users and items each; the file holds those numbers and its metadata the texts
    in that order (`names_metadata`: what an export's `features.json` maps raw ids with). Ratings
    may be on any scale `(0, rating_scale]`; the scale goes into the metadata too, and HSTU
    ranking reads the ratings and `data.thresholds` in it (`RATING_SCALE_KEY`).
    """
    if not rating_scale > 0:
        raise _refuse(f"--rating-scale must be > 0, got {rating_scale}", "--rating-scale")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recsys_pipe.data.in_memory.sequences import read_interactions
    from recsys_pipe.data.parquet.decode import RATING_SCALE_KEY, item_vocab_metadata
    from recsys_pipe.data.parquet.ranking import user_vocab_metadata, windows_metadata

    if windows is not None and not 0 < num_candidates < windows:
        raise _refuse(f"need 0 < --num-candidates ({num_candidates}) < --windows ({windows})", "--num-candidates")
    (output,) = _plan_outputs([source], destination, overwrite)
    data = read_interactions(source, csv, rating_scale, string_ids=None)
    if windows is not None and data.ratings is None:
        raise _refuse(
            f"{source}: --windows (HSTU ranking) needs a rating per event (they become the action ids and labels); "
            "the file has no rating column"
        )
    lengths = np.fromiter((len(s) for s in data.items), dtype=np.int64, count=len(data.items))
    user_ids, items, metadata = _numbered(data)
    flat = {"item_ids": (items, pa.int64())}
    if data.has_timestamps:
        flat["timestamps"] = (_flat(data.timestamps, np.int64), pa.int64())
    if data.ratings is not None:
        flat["actions"] = (_flat(data.ratings, np.float64), pa.float64())
        metadata[RATING_SCALE_KEY] = repr(float(rating_scale)).encode()
    metadata |= item_vocab_metadata(items)
    if windows is not None:
        owner, gather, lengths = _windows(lengths, windows, num_candidates)
        metadata |= user_vocab_metadata(user_ids) | windows_metadata(windows, num_candidates)
        user_ids = user_ids[owner]
        flat = {name: (values[gather], kind) for name, (values, kind) in flat.items()}
    columns = {"user_id": pa.array(user_ids), **_list_columns(flat, lengths)}
    # the item vocabulary travels in the file's metadata, so data=parquet_sequences numbers items
    # as data=sequences does without scanning them before the first step
    schema = sequence_schema(data.has_timestamps, data.ratings is not None).with_metadata(metadata)
    table = pa.Table.from_pydict(columns, schema=schema)
    partial_path = os.path.join(os.path.dirname(output), f".{os.path.basename(output)}.partial")
    try:
        pq.write_table(table, partial_path, row_group_size=row_group_size)
        os.replace(partial_path, output)
    finally:
        if os.path.exists(partial_path):
            os.remove(partial_path)
    return ConvertedFile(source, output, table.num_rows, pq.ParquetFile(output).num_row_groups)


def _list_columns(flat: dict[str, tuple[np.ndarray, Any]], lengths: np.ndarray) -> dict[str, Any]:
    """The flat `values` of each column as Arrow lists of `lengths` (64-bit offsets past 2^31 values)."""
    import pyarrow as pa

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32 if lengths.sum() < 2**31 else np.int64)
    list_type = pa.ListArray if offsets.dtype == np.int32 else pa.LargeListArray

    def lists(values: np.ndarray, kind):  # -> pyarrow array of lists
        array = list_type.from_arrays(pa.array(offsets), pa.array(values, kind))
        return array.cast(pa.list_(kind)) if list_type is pa.LargeListArray else array

    return {name: lists(values, kind) for name, (values, kind) in flat.items()}


def _numbered(data: Any) -> tuple[np.ndarray, np.ndarray, dict[bytes, bytes]]:
    """The users' and the events' item ids as int64, and the metadata of their names: integer ids
    as they are (none); text ids numbered in sorted order (users come sorted already)."""
    from recsys_pipe.data.parquet.decode import names_metadata

    if not data.users or not isinstance(data.users[0], str):
        return np.asarray(data.users, dtype=np.int64), _flat(data.items, np.int64), {}
    raw = np.array([item for seq in data.items for item in seq], dtype=str)
    item_names, items = np.unique(raw, return_inverse=True)
    users = np.arange(len(data.users), dtype=np.int64)
    return users, items.astype(np.int64), names_metadata(data.users, item_names.tolist())


def _windows(lengths: np.ndarray, size: int, num_candidates: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`data=movielens`' windows of users with `lengths` events, vectorised: per window its user,
    and the events of all windows (indices into the users' concatenated events) with each
    window's length. A user of `n` events has `ceil((n - num_candidates) / size)` windows (none
    at `n <= num_candidates`), ending at `n`, `n - size`, ...; stored oldest first."""
    count = np.maximum(-(-(lengths - num_candidates) // size), 0)
    owner = np.repeat(np.arange(len(lengths)), count)
    first_window = np.concatenate([[0], np.cumsum(count)])[:-1]
    nth = np.arange(int(count.sum())) - first_window[owner]  # 0: the user's oldest window
    end = lengths[owner] - size * (count[owner] - 1 - nth)
    start = np.maximum(end - size, 0)
    user_first = np.concatenate([[0], np.cumsum(lengths)])[:-1]
    window_lengths = end - start
    starts = user_first[owner] + start
    row = np.repeat(np.arange(len(owner)), window_lengths)
    within = np.arange(int(window_lengths.sum())) - np.concatenate([[0], np.cumsum(window_lengths)])[:-1][row]
    return owner, starts[row] + within, window_lengths


def _flat(lists: Sequence[Sequence], dtype: type) -> np.ndarray:
    return np.fromiter((v for seq in lists for v in seq), dtype=dtype) if lists else np.zeros(0, dtype)
