"""Bad rows of a Parquet table, all of them: what a decoder would refuse, row by row.

A decoder refuses the first bad row it meets (`data.on_bad_row=fail`, the default: one line
naming the file, row and column). `recsys-data inspect --scan` and `data.on_bad_row=skip` need
every bad row instead: each decoder's `validate(table)` returns `RowProblems`, the rows each
check refuses as boolean masks (vectorised: a mask per check, never a Python loop over rows),
with the message of each. `WindowDataset` drops the bad rows of a window before decoding it when
skipping (`recsys_pipe.data.parquet.stream`); the scan lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

__all__ = ["Problem", "RowProblems", "list_column", "null_rows"]


@dataclass(frozen=True)
class Problem:
    """One bad row: its row in the table, the column and what is wrong."""

    row: int
    column: str
    message: str


@dataclass
class _Check:
    column: str
    bad: np.ndarray
    message: Callable[[int], str]


@dataclass
class RowProblems:
    """The bad rows of a table of `rows` rows, check by check."""

    rows: int
    checks: list[_Check] = field(default_factory=list)

    def add(self, column: str, bad: np.ndarray, message: Callable[[int], str] | str) -> None:
        """Rows `bad` (a bool mask over the rows) are refused by a check of `column`; `message`:
        what is wrong (or a function of the row)."""
        if bad.any():
            text = message
            self.checks.append(_Check(column, bad, text if callable(text) else lambda row, m=text: m))

    def add_values(
        self, column: str, bad: np.ndarray, offsets: np.ndarray, message: Callable[[int], str] | str
    ) -> None:
        """Values `bad` of a list column (a mask over its flat values; `offsets`: each row's
        start, `[rows + 1]`) make their rows bad; `message`: a function of the value's index."""
        if not bad.any():
            return
        at = np.flatnonzero(bad)
        rows = np.searchsorted(offsets, at, side="right") - 1
        first = dict(zip(rows[::-1].tolist(), at[::-1].tolist()))  # each row's first bad value
        mask = np.zeros(self.rows, dtype=bool)
        mask[rows] = True
        text = message
        self.checks.append(
            _Check(column, mask, (lambda row: text(first[row])) if callable(text) else (lambda row: text))
        )

    @property
    def bad(self) -> np.ndarray:
        """`[rows]` bool: the rows some check refuses."""
        mask = np.zeros(self.rows, dtype=bool)
        for check in self.checks:
            mask |= check.bad
        return mask

    def __bool__(self) -> bool:
        return bool(self.checks)

    def first(self) -> Problem | None:
        """The problem of the first bad row (its first check)."""
        found = [(int(np.flatnonzero(c.bad)[0]), i) for i, c in enumerate(self.checks)]
        if not found:
            return None
        row, i = min(found)
        check = self.checks[i]
        return Problem(row, check.column, check.message(row))

    def listed(self, limit: int) -> tuple[list[Problem], int]:
        """Up to `limit` problems per check (row order), and how many were left out."""
        shown, left = [], 0
        for check in self.checks:
            rows = np.flatnonzero(check.bad)
            shown += [Problem(int(r), check.column, check.message(int(r))) for r in rows[:limit]]
            left += max(0, len(rows) - limit)
        return sorted(shown, key=lambda p: (p.row, p.column)), left


def null_rows(column: pa.ChunkedArray) -> np.ndarray:
    """`[rows]` bool: the null cells of a column."""
    if not column.null_count:
        return np.zeros(len(column), dtype=bool)
    return np.concatenate([np.asarray(c.is_null()) for c in column.chunks]) if column.num_chunks else np.zeros(0, bool)


def list_column(column: pa.ChunkedArray) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """A list column's flat values (one array), each row's offsets into them (`[rows + 1]`, from
    0; a null list is empty) and the null lists (`[rows]` bool)."""
    joined = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    nulls = np.asarray(joined.is_null()) if joined.null_count else np.zeros(len(joined), dtype=bool)
    offsets = np.asarray(joined.offsets, dtype=np.int64)
    offsets = offsets - offsets[0]
    if nulls.any():  # a null list's offsets span nothing in Arrow; made explicit
        lengths = np.where(nulls, 0, np.diff(offsets))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
    return joined.flatten(), offsets, nulls
