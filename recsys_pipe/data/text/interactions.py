"""Interaction files: one (user, item[, rating][, timestamp]) event per line, read column-wise.

What `data=movielens`, `data=sequences` and `recsys-data convert sequences` read: MovieLens
`ratings.dat` (`::`-separated), `ratings.csv` (with or without a header, any column names),
SASRec's "user item" lines (white space) and any other delimited file whose columns are named by
`data.csv.*` (`CsvConfig`).

pyarrow's CSV reader parses the file (vectorised, on every core) and the values are checked
column-wise. A file it refuses, or one with a bad value, is read again line by line
(`_python_columns`), which names the file and line of the first bad row, or accepts what the
stricter fast path refused (e.g. `1 2` with two spaces, ` 5` with a space). Every rank reads the
whole file: grouping events by user and numbering the items densely need every line (large data
sets: `recsys-data convert sequences` and `data=parquet_sequences`).
"""

from __future__ import annotations

import codecs
import csv
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
from pydantic import Field, StrictBool, StrictStr

from recsys_pipe.config import Section
from recsys_pipe.data.text.files import fail

__all__ = [
    "ROLES",
    "ColumnLayout",
    "CsvConfig",
    "InteractionColumns",
    "detect_layout",
    "has_string_ids",
    "read_interaction_columns",
]

ROLES = ("user", "item", "rating", "timestamp")
#: header names (lower case) that name each role when `data.csv.columns` is not given
ROLE_NAMES = {
    "user": ("user", "userid", "user_id", "reviewerid"),
    "item": ("item", "itemid", "item_id", "movie", "movieid", "movie_id", "asin"),
    "rating": ("rating", "overall", "score"),
    "timestamp": ("timestamp", "time", "ts", "unixreviewtime"),
}
#: timestamps must fit in int64 with room for differences between two of them
MAX_TIMESTAMP = 2**62


class CsvConfig(Section):
    """How to read a delimited interactions file (`data.csv.*`); each key is detected from the file
    when null."""

    delimiter: StrictStr | None = Field(
        None,
        description="column separator, e.g. ',' or '\\t' or '::' (null: detected from the first line: '::', ',', "
        "tab, else white space)",
    )
    header: StrictBool | None = Field(
        None, description="whether the first line names the columns (null: yes when its first field is not a number)"
    )
    columns: list[StrictStr] | None = Field(
        None,
        description="the file's columns in order, each one of user, item, rating, timestamp or any other name for a "
        "column to skip (null: from the header's names, e.g. userId/movieId/rating/timestamp, else user item "
        "[rating timestamp])",
    )


@dataclass(frozen=True)
class ColumnLayout:
    """How a file is read: its delimiter (None: runs of white space), whether line 1 is a header,
    and the role of each column (None: skipped)."""

    delimiter: str | None
    header: bool
    roles: tuple[str | None, ...]
    #: bytes of a UTF-8 byte order mark before line 1
    bom: int

    @property
    def is_pairs(self) -> bool:
        """SASRec's "user item" lines."""
        return self.delimiter is None and self.roles == ("user", "item")


@dataclass
class InteractionColumns:
    """One entry per event, in file order."""

    user: np.ndarray
    item: np.ndarray
    rating: np.ndarray | None
    timestamp: np.ndarray | None

    def __len__(self) -> int:
        return len(self.user)


def _excerpt(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _split(line: str, delimiter: str | None) -> list[str]:
    if delimiter is None:
        return line.split()
    if len(delimiter) == 1:
        return next(csv.reader([line], delimiter=delimiter), [])
    return line.split(delimiter)


def detect_layout(path: str, cfg: CsvConfig, layout_help: str) -> ColumnLayout:
    """The file's layout: `cfg`'s keys, the rest detected from the first line. Refuses in one line
    a first line whose columns cannot be told (naming `data.csv.columns`)."""
    try:
        with open(path, "rb") as raw:
            head = raw.read(8192)
    except OSError as exc:
        fail(path, None, f"cannot read the file ({exc.strerror or exc})")
    if b"\0" in head:
        fail(path, None, f"a binary file, not text; {layout_help}")
    bom = len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0
    first = head[bom:].decode("latin-1").splitlines()[0] if head[bom:].strip() else ""
    delimiter = cfg.delimiter
    if delimiter is None:
        delimiter = next((d for d in ("::", ",", "\t") if d in first), None)
    fields = [f.strip() for f in _split(first, delimiter)]
    header = cfg.header if cfg.header is not None else bool(fields) and not _is_int(fields[0])
    if cfg.columns is not None:
        roles = tuple(c if c in ROLES else None for c in cfg.columns)
    elif header:
        roles = tuple(next((r for r, names in ROLE_NAMES.items() if f.lower() in names), None) for f in fields)
    elif len(fields) in (2, 4):
        roles = ROLES[:2] if len(fields) == 2 else ROLES
    else:
        roles = ()
    if first and not {"user", "item"} <= set(roles):
        fail(
            path, 1, f"unrecognised first line {_excerpt(first)}; {layout_help}; or name the columns: data.csv.columns"
        )
    return ColumnLayout(delimiter, header, roles, bom)


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def read_interaction_columns(
    path: str, layout: ColumnLayout, layout_help: str, rating_scale: float = 5.0, string_ids: bool = False
) -> InteractionColumns:
    """Every event of the file, checked: integer user and item ids (or, with `string_ids`, any
    text: str arrays), a timestamp in [0, 2^62), a rating in (0, rating_scale]. A bad row is a
    ConfigError at `data.path` naming the file and line."""
    columns = _arrow_columns(path, layout, rating_scale, string_ids)
    return columns if columns is not None else _python_columns(path, layout, layout_help, rating_scale, string_ids)


def has_string_ids(path: str, layout: ColumnLayout) -> bool:
    """Whether the first lines of the file (its first 8 KiB) hold a user or item id that is not an
    integer (`u17`, `B00005N7P0`): such a file's ids are read as text."""
    with open(path, encoding="latin-1", newline="") as f:
        f.seek(layout.bom)
        text = f.read(8192)
    lines = text.splitlines()[int(layout.header) :]
    if len(text) == 8192:
        lines = lines[:-1]  # cut in the middle
    ids = [i for i, r in enumerate(layout.roles) if r in ("user", "item")]
    for line in lines:
        row = _split(line, layout.delimiter)
        if len(row) == len(layout.roles) and any(not _is_int(row[i].strip()) for i in ids):
            return True
    return False


def _arrow_columns(path: str, layout: ColumnLayout, rating_scale: float, string_ids: bool) -> InteractionColumns | None:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    roles = layout.roles
    if layout.delimiter == "::":  # pyarrow splits on one character: every other column is empty
        names = [f"c{i}" for i in range(2 * len(roles) - 1)]
        role_of = {f"c{2 * i}": r for i, r in enumerate(roles)}
        separators = names[1::2]
    else:
        names = [f"c{i}" for i in range(len(roles))]
        role_of = dict(zip(names, roles))
        separators = []
    text = {"user": pa.string(), "item": pa.string()} if string_ids else {}
    kinds = {"rating": pa.float64(), None: pa.binary(), **text}
    types = {n: kinds.get(r, pa.int64()) for n, r in role_of.items()}
    types.update(dict.fromkeys(separators, pa.binary()))
    delimiter = {None: " ", "::": ":"}.get(layout.delimiter, layout.delimiter)
    if len(delimiter) != 1:
        return None
    try:
        table = pacsv.read_csv(
            path,
            read_options=pacsv.ReadOptions(column_names=names, skip_rows=int(layout.header)),
            parse_options=pacsv.ParseOptions(delimiter=delimiter, quote_char='"' if delimiter == "," else False),
            convert_options=pacsv.ConvertOptions(
                column_types=types,
                include_columns=[n for n, r in role_of.items() if r is not None] + separators,
                null_values=[],
                strings_can_be_null=False,
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError):
        return None
    if any(pc.max(pc.binary_length(table.column(s))).as_py() for s in separators if table.num_rows):
        return None
    got = {r: table.column(n).to_numpy(zero_copy_only=False) for n, r in role_of.items() if r is not None}
    if string_ids:
        got["user"], got["item"] = (np.asarray(got[r], dtype=str) for r in ("user", "item"))
    rating, stamp = got.get("rating"), got.get("timestamp")
    if rating is not None and not np.all((rating > 0) & (rating <= rating_scale)):
        return None
    if stamp is not None and not np.all((stamp >= 0) & (stamp < MAX_TIMESTAMP)):
        return None
    return InteractionColumns(got["user"], got["item"], rating, stamp)


#: the range of the int64 arrays the ids are kept in
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _python_columns(
    path: str, layout: ColumnLayout, layout_help: str, rating_scale: float, string_ids: bool
) -> InteractionColumns:
    """The line-by-line reader: the reference for what is accepted and for every error message."""
    roles = layout.roles
    wanted = {r: i for i, r in enumerate(roles) if r is not None}
    values: dict[str, list] = {r: [] for r in wanted}
    try:
        with open(path, newline="", encoding="latin-1") as f:
            f.seek(layout.bom)
            for number, line in enumerate(f, 1):
                if (number == 1 and layout.header) or not line.strip():
                    continue
                row = _split(line.rstrip("\r\n"), layout.delimiter)
                if len(row) != len(roles):
                    _wrong_width(path, number, line, row, layout, layout_help)
                try:
                    parsed = {r: _PARSE[r if r in _PARSE else "id"](row[i], string_ids) for r, i in wanted.items()}
                except ValueError:
                    _not_numbers(path, number, line, row, layout)
                for r in ("user", "item"):
                    if r in parsed and not string_ids and not _INT64_MIN <= parsed[r] <= _INT64_MAX:
                        fail(path, number, f"{r} id {row[wanted[r]]!r} does not fit in a 64-bit integer")
                if "rating" in parsed and not 0 < parsed["rating"] <= rating_scale:  # also refuses nan and inf
                    fail(path, number, f"rating {row[wanted['rating']]!r} is outside (0, {rating_scale:g}]")
                if "timestamp" in parsed and not 0 <= parsed["timestamp"] < MAX_TIMESTAMP:
                    fail(path, number, f"timestamp {row[wanted['timestamp']]!r} is not a unix time in seconds")
                for r, v in parsed.items():
                    values[r].append(v)
    except OSError as exc:
        fail(path, None, f"cannot read the file ({exc.strerror or exc})")
    kinds = {"rating": np.float64, "user": str if string_ids else np.int64, "item": str if string_ids else np.int64}
    arrays = {r: np.array(v, dtype=kinds.get(r, np.int64)) for r, v in values.items()}
    return InteractionColumns(arrays["user"], arrays["item"], arrays.get("rating"), arrays.get("timestamp"))


#: how the line-by-line reader reads a field of each role (`id`: a user or an item)
_PARSE = {
    "rating": lambda text, string_ids: float(text),
    "timestamp": lambda text, string_ids: int(text),
    "id": lambda text, string_ids: text.strip() if string_ids else int(text),
}


def _labels(layout: ColumnLayout) -> list[str]:
    item = "movie" if "rating" in layout.roles else "item"
    return [{"item": item}.get(r, r) if r is not None else "skipped" for r in layout.roles]


def _wrong_width(path: str, number: int, line: str, row: list[str], layout: ColumnLayout, help_: str) -> NoReturn:
    if layout.is_pairs:
        text = line.rstrip("\r\n")
        fail(path, number, f"expected two fields `user item`, got {_excerpt(text)}; {help_}")
    fail(
        path,
        number,
        f"expected {len(layout.roles)} fields ({', '.join(_labels(layout))}), got {len(row)}: {_excerpt(row)}",
    )


def _not_numbers(path: str, number: int, line: str, row: list[str], layout: ColumnLayout) -> NoReturn:
    if layout.is_pairs:
        fail(path, number, f"user and item must be integers, got {line.strip()!r}")
    ints = [lab for lab, r in zip(_labels(layout), layout.roles) if r in ("user", "item", "timestamp")]
    rating = " and a numeric rating" if "rating" in layout.roles else ""
    fail(path, number, f"fields must be integer {', '.join(ints)}{rating}: {_excerpt(row)}")
