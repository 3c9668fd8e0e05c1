"""Criteo TSV text: rows parsed through pyarrow, with the line-by-line reader's one-line errors.

A row is `label`, 13 integer features and 26 categorical features, tab-separated: the layout of
the Kaggle display-advertising challenge's `train.txt` and of the Terabyte click logs' `day_N`
files. An integer may be empty (read as 0); a categorical value is a hexadecimal id, possibly
empty (read as 0).

Parsing is chunked (`recsys_pipe.data.text.files`): pyarrow's CSV reader and vectorised checks
read a chunk of whole lines at once; a chunk they refuse is parsed again line by line
(`_parse_line`), which names the file and line of the first bad row, or accepts what the strict
fast path refused (Python's `int(v, 16)` also reads `0x1f` or ` 1f`). This module imports no
torch, so `recsys-data convert criteo` starts quickly.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.data.text.files import Chunk, check_text_head, count_lines, line_chunks, parallel_map, share

__all__ = [
    "CATEGORICAL_KEYS",
    "DENSE_NAMES",
    "LAYOUT",
    "NUM_CATEGORICAL",
    "NUM_DENSE",
    "CriteoRows",
    "decode_hex_ids",
    "parse_criteo_chunk",
    "raw_criteo_rows",
    "read_criteo",
]

NUM_DENSE = 13
NUM_CATEGORICAL = 26
#: Column names as torchrec's Criteo tools call them; the categorical ones are the batches' KJT keys.
DENSE_NAMES: tuple[str, ...] = tuple(f"int_{i}" for i in range(NUM_DENSE))
CATEGORICAL_KEYS: tuple[str, ...] = tuple(f"cat_{i}" for i in range(NUM_CATEGORICAL))
NUM_COLUMNS = 1 + NUM_DENSE + NUM_CATEGORICAL


def _problem(path: str, line: int, message: str) -> ConfigError:
    return ConfigError(ConfigProblem("data.path", f"{path}:{line}: {message}"))


LAYOUT = (
    f"expected Criteo TSV rows: a 0/1 label, {NUM_DENSE} integer and {NUM_CATEGORICAL} hexadecimal columns, "
    "tab-separated"
)


@dataclass(frozen=True)
class CriteoRows:
    """Parsed Criteo rows, raw (not yet transformed or hashed), column-major.

    Attributes:
        labels: `[N]` int8 clicks (0 or 1).
        integers: `[13, N]` int64, the integer columns (empty: 0).
        categorical: `[26, N]` int64, the hexadecimal ids as integers (empty: 0).
        first_line: the 1-based line number of the first row (row i is line `first_line + i`).
    """

    labels: np.ndarray
    integers: np.ndarray
    categorical: np.ndarray
    first_line: int

    def __len__(self) -> int:
        return len(self.labels)


def read_criteo(
    path: str, rank: int = 0, world_size: int = 1, max_rows: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Parse this rank's rows of a Criteo TSV file: the contiguous rows `share(N, rank, world_size)`
    of its N rows (at most `max_rows`, from the start).

    The rank finds its lines by counting line ends (`recsys_pipe.data.text.files.count_lines`) and
    parses only its own, through pyarrow (`parse_criteo_chunk`).

    Args:
        path: the file (label, 13 integer and 26 hexadecimal categorical columns, tab-separated).
        rank: this rank.
        world_size: the number of ranks reading the file.
        max_rows: read only the file's first rows.

    Returns:
        `(integers [N, 13] int64, categorical ids [N, 26] int64, labels [N] float32, line numbers
        [N] int64)`, raw (not yet transformed or hashed). Raises ConfigError naming the file and
        line of the first malformed row of this rank's share."""
    check_text_head(path, LAYOUT)
    lines = count_lines(path, max_rows)
    lo, hi = share(lines.num_lines, rank, world_size)
    chunks = line_chunks(path, lines.offset(lo), lines.offset(hi), lo + 1)
    parts = list(parallel_map(partial(parse_criteo_chunk, path), chunks))
    if not parts:
        none = np.zeros((0,), np.int64)
        return none.reshape(0, NUM_DENSE), none.reshape(0, NUM_CATEGORICAL), none.astype(np.float32), none
    return (
        np.concatenate([p.integers for p in parts], axis=1).T,
        np.concatenate([p.categorical for p in parts], axis=1).T,
        np.concatenate([p.labels for p in parts]).astype(np.float32),
        np.arange(lo + 1, hi + 1, dtype=np.int64),
    )


def raw_criteo_rows(path: str, lines: list[int]) -> list[dict[str, int | str | None]]:
    """The rows at the 1-based line numbers `lines` (in that order) as the file holds them:
    `{label: 0|1, int_<i>: int or None (empty), cat_<i>: the hexadecimal string or None}`."""
    wanted = set(lines)
    found: dict[int, dict[str, int | str | None]] = {}
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        for number, line in enumerate(f, 1):
            if number in wanted:
                _parse_line(path, number, line)  # the reader's checks: a row that trained is valid
                fields = line.rstrip("\r\n").split("\t")
                row: dict[str, int | str | None] = {"label": int(fields[0])}
                row.update({k: int(v) if v else None for k, v in zip(DENSE_NAMES, fields[1 : 1 + NUM_DENSE])})
                row.update({k: v or None for k, v in zip(CATEGORICAL_KEYS, fields[1 + NUM_DENSE :])})
                found[number] = row
                if len(found) == len(wanted):
                    break
    return [found[n] for n in lines]


def parse_criteo_chunk(path: str, chunk: Chunk) -> CriteoRows:
    """Parse a chunk of whole Criteo lines: pyarrow's CSV reader and vectorised checks; a chunk that
    they refuse is parsed again line by line, which raises ConfigError naming the file and line of
    the first bad row (or accepts what the strict fast path refused, e.g. `0x1f` ids)."""
    rows = _arrow_rows(chunk)
    return rows if rows is not None else _python_rows(path, chunk)


#: pyarrow's CSV options for a Criteo chunk: tabs, no quoting, every line a row (an empty line is a
#: row of one column, refused), only an empty field is missing
_COLUMN_NAMES = ["label", *DENSE_NAMES, *CATEGORICAL_KEYS]


def _arrow_rows(chunk: Chunk) -> CriteoRows | None:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    # bytes, not UTF-8 strings: no UTF-8 check, and a non-ASCII byte fails the hexadecimal check
    types = {"label": pa.binary(), **dict.fromkeys(DENSE_NAMES, pa.int64())}
    types.update(dict.fromkeys(CATEGORICAL_KEYS, pa.binary()))
    try:
        table = pacsv.read_csv(
            pa.py_buffer(chunk.data),
            read_options=pacsv.ReadOptions(column_names=_COLUMN_NAMES, block_size=4 << 20),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, ignore_empty_lines=False),
            convert_options=pacsv.ConvertOptions(
                column_types=types, null_values=[""], strings_can_be_null=False, quoted_strings_can_be_null=False
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    if table.num_rows != chunk.num_lines:
        return None
    label = table.column("label")
    is_one = pc.equal(label, b"1")
    if not pc.all(pc.or_(is_one, pc.equal(label, b"0"))).as_py():
        return None
    integers = np.empty((NUM_DENSE, table.num_rows), np.int64)
    for j, name in enumerate(DENSE_NAMES):
        integers[j] = pc.fill_null(table.column(name), 0).to_numpy()
    categorical = np.empty((NUM_CATEGORICAL, table.num_rows), np.int64)
    for j, name in enumerate(CATEGORICAL_KEYS):
        if not decode_hex_ids(table.column(name), categorical[j]):
            return None
    return CriteoRows(is_one.to_numpy(zero_copy_only=False).astype(np.int8), integers, categorical, chunk.first_line)


def _python_rows(path: str, chunk: Chunk) -> CriteoRows:
    labels: list[int] = []
    dense: list[list[int]] = []
    cats: list[list[int]] = []
    with io.TextIOWrapper(io.BytesIO(chunk.data), encoding="utf-8", errors="replace", newline="") as f:
        for lineno, line in enumerate(f, chunk.first_line):
            label, row_dense, row_cats = _parse_line(path, lineno, line)
            labels.append(label)
            dense.append(row_dense)
            cats.append(row_cats)
    return CriteoRows(
        np.array(labels, dtype=np.int8),
        np.array(dense, dtype=np.int64).reshape(-1, NUM_DENSE).T.copy(),
        np.array(cats, dtype=np.int64).reshape(-1, NUM_CATEGORICAL).T.copy(),
        chunk.first_line,
    )


def _parse_line(path: str, lineno: int, line: str) -> tuple[int, list[int], list[int]]:
    """One row as the line-by-line reader always parsed it, or its one-line error."""
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != NUM_COLUMNS:
        hint = " (an unlabelled file such as Kaggle's test.txt cannot be trained on)" if len(fields) == 39 else ""
        raise _problem(
            path,
            lineno,
            f"expected {NUM_COLUMNS} tab-separated columns (label, {NUM_DENSE} integer, {NUM_CATEGORICAL} "
            f"categorical), found {len(fields)}{hint}",
        )
    if fields[0] not in ("0", "1"):
        raise _problem(path, lineno, f"label {fields[0]!r} is not 0 or 1")
    try:
        row_dense = [int(v) if v else 0 for v in fields[1 : 1 + NUM_DENSE]]
    except ValueError:
        col = next(i for i, v in enumerate(fields[1 : 1 + NUM_DENSE]) if v and not _is_int(v))
        raise _problem(path, lineno, f"column {DENSE_NAMES[col]} ({fields[1 + col]!r}) is not an integer") from None
    try:
        row_cats = [int(v, 16) if v else 0 for v in fields[1 + NUM_DENSE :]]
    except ValueError:
        col = next(i for i, v in enumerate(fields[1 + NUM_DENSE :]) if v and not _is_hex(v))
        raise _problem(
            path, lineno, f"column {CATEGORICAL_KEYS[col]} ({fields[1 + NUM_DENSE + col]!r}) is not a hexadecimal id"
        ) from None
    for col, value in enumerate(row_dense):  # kept as int64: a larger one is a bad row, not a crash
        if not -_INT64 <= value < _INT64:
            raise _problem(path, lineno, f"column {DENSE_NAMES[col]} ({value}) is outside the 64-bit range")
    for col, value in enumerate(row_cats):
        if not 0 <= value < _INT64:
            raise _problem(
                path,
                lineno,
                f"column {CATEGORICAL_KEYS[col]} ({fields[1 + NUM_DENSE + col]!r}) is not a hexadecimal id "
                "in [0, 2^63)",
            )
    return int(fields[0]), row_dense, row_cats


#: ids and counts are held as int64
_INT64 = 2**63


def _is_int(value: str) -> bool:
    try:
        int(value)
    except ValueError:
        return False
    return True


def _is_hex(value: str) -> bool:
    try:
        int(value, 16)
    except ValueError:
        return False
    return True


#: ASCII byte -> its hexadecimal digit, 255 for any other byte
_HEX_DIGIT = np.full(256, 255, dtype=np.uint8)
_HEX_DIGIT[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX_DIGIT[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX_DIGIT[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


def decode_hex_ids(column: Any, out: np.ndarray) -> bool:
    """Write the hexadecimal strings of an Arrow string column (empty: 0) into `out` as int64;
    False if a value is not 1-16 hexadecimal digits below 2^63 (the caller then reports the row).

    Vectorised over the column's data buffer: every value of Criteo's files has 8 digits or none,
    which is read as a `[n, 8]` byte matrix directly; other widths are padded to 16 first."""
    import pyarrow as pa
    import pyarrow.compute as pc

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if array.null_count:
        return False
    offsets = np.frombuffer(array.buffers()[1], np.int32)[array.offset : array.offset + len(array) + 1]
    lengths = np.diff(offsets)
    data = np.frombuffer(array.buffers()[2], np.uint8) if array.buffers()[2] is not None else np.zeros(0, np.uint8)
    data = data[offsets[0] : offsets[-1]]
    width = 8
    filled = lengths != 0
    if not np.all((lengths == 8) | ~filled):
        if lengths.max(initial=0) > 16:
            return False
        padded = pc.binary_join_element_wise(pc.binary_repeat(b"0", pc.subtract(16, lengths)), array, b"")
        poffsets = np.frombuffer(padded.buffers()[1], np.int32)[padded.offset : padded.offset + len(padded) + 1]
        data = np.frombuffer(padded.buffers()[2], np.uint8)[poffsets[0] : poffsets[-1]]
        width, filled = 16, np.ones(len(array), dtype=bool)
    digits = _HEX_DIGIT[data].reshape(-1, width)
    if digits.size and digits.max() == 255:
        return False
    packed = np.ascontiguousarray((digits[:, 0::2] << 4) | digits[:, 1::2])
    values = packed.view(">u4" if width == 8 else ">u8").reshape(-1)
    if width == 16 and values.size and (packed[:, 0] >= 0x80).any():
        return False
    if filled.all():
        out[:] = values
    else:
        out[:] = 0
        out[filled] = values
    return True
