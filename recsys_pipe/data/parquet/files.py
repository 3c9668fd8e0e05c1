"""The Parquet files of a data source, found and checked from their metadata alone.

`open_parquet(path, key)` resolves `data.path` (a file, a directory, a glob, a list of them, on
any filesystem pyarrow reads: a local path, `file://`, `s3://`, `gs://`, `hdfs://`), reads every
file's footer (schema, row groups, column statistics) and returns a `ParquetFiles`: the files in
sorted path order with the row count of each row group. Nothing else is read: a rank later
decodes only the row groups its rows are in (`ParquetFiles.read`).

Every problem is a `ConfigError` at the config key (`data.path`, `data.eval_path`) whose message
names the file, and where it applies the row group and column, in one line: a path that matches
nothing, a file that is not Parquet or is truncated, a file with no rows, a schema that differs
from the first file's, a missing column or one of the wrong type. A row group that cannot be
decoded mid-run raises the same kind of error (`DataFileError`).
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from recsys_pipe.config import ConfigError, ConfigProblem

__all__ = ["Collected", "DataFileError", "ParquetFiles", "RowGroupStats", "open_parquet", "read_rows"]

_GLOB_CHARS = "*?["


class DataFileError(ConfigError):
    """A data file that cannot be used: one `ConfigProblem` at the config key naming the file
    (and row group and column where known). `recsys-train` exits 2 with its one line."""

    def __init__(self, key: str, where: str, message: str) -> None:
        super().__init__(ConfigProblem(key, f"{where}: {message}"))
        self.key, self.where, self.message = key, where, message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.where, self.message))


class Collected:
    """The problems of several checks that each raise a ConfigError, raised together
    (`raise_all`): a config with three missing columns says so in one run, not in three.

        found = Collected()
        for name in names:
            with found:
                check(name)
        found.raise_all()
    """

    #: problems kept; the rest are counted into one last problem
    LIMIT = 20

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []
        self.more = 0

    def __enter__(self) -> Collected:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> bool:
        if not isinstance(error, ConfigError):
            return False
        if len(self.errors) < self.LIMIT:
            self.errors.append(error)
        else:
            self.more += len(error.problems)
        return True

    def raise_all(self) -> None:
        """Raise what was collected: one error as it is, several as one ConfigError."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if not self.errors:
            return
        problems = [p for error in self.errors for p in error.problems]
        if self.more:
            hint = "(`recsys-data inspect --scan` lists every bad row)"
            problems.append(ConfigProblem(problems[-1].path, f"and {self.more} more problem(s) {hint}"))
        raise ConfigError(problems)


@dataclass(frozen=True)
class RowGroupStats:
    """A column chunk's statistics, where the writer stored them (None: not stored)."""

    min: Any
    max: Any
    null_count: int | None


@dataclass
class ParquetFiles:
    """The files of one data set (sorted paths) and the row counts of their row groups.

    A row's *global position* is its 0-based position over the files in this order: the sample
    id of a tabular row, and how ranks and windows address rows.
    """

    key: str
    filesystem: pafs.FileSystem
    paths: list[str]
    #: rows of each row group, per file
    row_groups: list[list[int]]
    schema: pa.Schema
    #: the first file's key-value metadata (what a converter stored, e.g. a vocabulary)
    metadata: Mapping[bytes, bytes]
    #: what messages put before a path: `s3://` for files on S3 (the filesystem's paths have none)
    scheme: str = ""
    _open: dict[int, pq.ParquetFile] = field(default_factory=dict, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_open"] = {}  # open files stay in the process that opened them (DataLoader workers)
        return state

    @property
    def num_rows(self) -> int:
        """Rows over all files."""
        return int(sum(sum(groups) for groups in self.row_groups))

    def units(self) -> np.ndarray:
        """`[U, 3]` int64: per row group (file order, then row-group order) its file, row group
        and first global row; `units()[:, 2]` is increasing."""
        rows = [(f, g, n) for f, groups in enumerate(self.row_groups) for g, n in enumerate(groups)]
        out = np.zeros((len(rows), 3), dtype=np.int64)
        if rows:
            arr = np.array(rows, dtype=np.int64)
            out[:, :2] = arr[:, :2]
            out[1:, 2] = np.cumsum(arr[:-1, 2])
        return out

    def unit_rows(self) -> np.ndarray:
        """`[U]` rows of each row group, in `units()` order."""
        return np.array([n for groups in self.row_groups for n in groups], dtype=np.int64)

    def where(self, file: int, row_group: int | None = None, column: str | None = None, row: int | None = None) -> str:
        """`path[, row r (row group g) | , row group g][, column c]`: what an error names; `row`
        is the row within the row group, named as the 0-based row of the file."""
        text = self.scheme + self.paths[file]
        if row_group is not None and row is not None:
            text += f", row {sum(self.row_groups[file][:row_group]) + row} (row group {row_group})"
        elif row_group is not None:
            text += f", row group {row_group}"
        if column is not None:
            text += f", column {column!r}"
        return text

    def _file(self, file: int) -> pq.ParquetFile:
        """The file's reader; the `_OPEN_FILES` most recently read stay open.

        A reader that pre-buffers keeps the raw bytes of the row group it read last (about 20
        MiB for 131,072 Criteo rows), so with every file kept open a worker's memory grew with
        the number of files (measured: +170 MiB from 2 to 8 files). On a local disk nothing is
        pre-buffered (as fast, measured); on an object store pre-buffering merges a row group's
        column reads into few requests, and the cap bounds what it holds."""
        handle = self._open.pop(file, None)
        if handle is None:
            local = isinstance(self.filesystem, pafs.LocalFileSystem)
            # a local file by its path: pyarrow then reads it buffered, where a filesystem's input
            # file is read in many small reads (row groups decoded ~25 % slower, measured on list columns)
            source = self.paths[file] if local else self.filesystem.open_input_file(self.paths[file])
            handle = pq.ParquetFile(source, pre_buffer=not local)
        self._open[file] = handle  # the most recent last
        while len(self._open) > _OPEN_FILES:
            self._open.pop(next(iter(self._open)))
        return handle

    def read(self, file: int, row_group: int, columns: Sequence[str]) -> pa.Table:
        """Decode `columns` of one row group; a `DataFileError` naming it if that fails (a file
        changed or damaged since the start: the run stops with that line, its checkpoints intact)."""
        try:
            return self._file(file).read_row_group(row_group, columns=list(columns))
        except (pa.ArrowException, OSError, ValueError) as exc:
            self._open.pop(file, None)
            raise DataFileError(self.key, self.where(file, row_group), f"cannot be decoded ({_reason(exc)})") from None


#: readers kept open per process (`ParquetFiles._file`)
_OPEN_FILES = 2


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    if "://" in path:
        try:
            return pafs.FileSystem.from_uri(path)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise ValueError(f"cannot open {path}: {_reason(exc)}") from None
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def _is_data_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return not name.startswith((".", "_"))  # Spark/Hive markers (_SUCCESS, _metadata), hidden files


def _scheme(entry: str) -> str:
    """`s3://` of a URI on an object store (its filesystem's paths lack it), else ''."""
    head = entry.split("://", 1)[0] if "://" in entry else ""
    return f"{head}://" if head and head != "file" else ""


def _expand(entry: str) -> tuple[pafs.FileSystem, list[str]]:
    fs, path = _filesystem(entry)
    if any(c in path for c in _GLOB_CHARS):
        parts = path.split("/")
        fixed = next(i for i, part in enumerate(parts) if any(c in part for c in _GLOB_CHARS))
        base = "/".join(parts[:fixed]) or "/"
        try:
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"cannot list {base}: {_reason(exc)}") from None
        matches = [i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatchcase(i.path, path)]
        return fs, sorted(m for m in matches if _is_data_file(m))
    try:
        info = fs.get_file_info(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"cannot open {entry}: {_reason(exc)}") from None
    if info.type == pafs.FileType.NotFound:
        raise ValueError(f"no such file or directory: {entry}")
    if info.type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        files = [i.path for i in infos if i.type == pafs.FileType.File and _is_data_file(i.path)]
        return fs, sorted(files)
    return fs, [path]


def _schema_difference(first: pa.Schema, other: pa.Schema) -> str | None:
    for f in first:
        i = other.get_field_index(f.name)
        if i < 0:
            return f"column {f.name!r} is missing (the first file has it)"
        if not other.field(i).type.equals(f.type):
            return f"column {f.name!r} is {other.field(i).type}, but {f.type} in the first file"
    for f in other:
        if first.get_field_index(f.name) < 0:
            return f"column {f.name!r} is not in the first file"
    return None


SchemaCheck = Callable[["ParquetFiles"], None]
"""Checks the columns once the first file's schema is read (raises a `DataFileError`)."""
StatsCheck = Callable[["ParquetFiles", int, int, dict[str, RowGroupStats]], None]
"""`check(files, file, row_group, stats)`: checks one row group's column statistics."""


def open_parquet(
    path: str | Sequence[str],
    key: str = "data.path",
    check_schema: SchemaCheck | None = None,
    check_stats: StatsCheck | None = None,
    stats_columns: Sequence[str] = (),
) -> ParquetFiles:
    """Find the files of `path` and read their footers (see the module docstring).

    Args:
        path: a file, directory, glob or URI, or a list of them.
        key: the config key named in errors.
        check_schema: run on the first file's schema, before the other files are read.
        check_stats: run on every row group's statistics of `stats_columns` as its footer is
            read (the statistics are not kept: a data set may have a million row groups).
        stats_columns: the columns `check_stats` gets.

    Returns:
        The files in sorted path order, their row groups and the first file's schema."""
    entries = [path] if isinstance(path, str) else list(path)
    if not entries:
        raise ConfigError(ConfigProblem(key, "names no file"))
    filesystem: pafs.FileSystem | None = None
    paths: list[str] = []
    for entry in entries:
        try:
            fs, found = _expand(entry)
        except ValueError as exc:
            raise ConfigError(ConfigProblem(key, str(exc))) from None
        if not found:
            raise ConfigError(ConfigProblem(key, f"{entry}: matches no file"))
        if filesystem is not None and fs.type_name != filesystem.type_name:
            raise ConfigError(ConfigProblem(key, f"{entry}: all files must be on one filesystem"))
        filesystem = fs
        paths += found
    paths = sorted(set(paths))
    assert filesystem is not None
    files = ParquetFiles(key, filesystem, paths, [], pa.schema([]), {}, scheme=_scheme(entries[0]))
    found = Collected()  # every row group's statistics are checked: all their problems in one run
    for index, file_path in enumerate(paths):
        try:
            meta = pq.ParquetFile(filesystem.open_input_file(file_path)).metadata
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise DataFileError(key, files.where(index), f"not a Parquet file, or truncated ({_reason(exc)})") from None
        if meta.num_rows == 0:
            raise DataFileError(key, files.where(index), "the file has no rows")
        if index == 0:
            files.schema = schema
            files.metadata = dict(schema.metadata or {})
            if check_schema is not None:
                check_schema(files)
        else:
            difference = _schema_difference(files.schema, schema)
            if difference is not None:
                raise DataFileError(
                    key, files.where(index), f"a schema that differs from {files.where(0)}'s: {difference}"
                )
        files.row_groups.append([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        if check_stats is not None and stats_columns:
            _check_stats(files, index, meta, stats_columns, check_stats, found)
    found.raise_all()
    return files


def _check_stats(
    files: ParquetFiles, file: int, meta: pq.FileMetaData, columns: Sequence[str], check: StatsCheck, found: Collected
) -> None:
    # leaf columns by dotted path: a list column's values are `name.list.element` (or `.item`)
    leaves: dict[str, int] = {}
    for i in range(meta.num_columns):
        dotted = meta.schema.column(i).path
        top = dotted.split(".", 1)[0]
        leaves.setdefault(top, i)
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        kept: dict[str, RowGroupStats] = {}
        for name in columns:
            leaf = leaves.get(name)
            if leaf is None:
                continue
            st = group.column(leaf).statistics
            if st is None:
                continue
            has_minmax = st.has_min_max
            kept[name] = RowGroupStats(
                st.min if has_minmax else None,
                st.max if has_minmax else None,
                st.null_count if st.has_null_count else None,
            )
        with found:
            check(files, file, g, kept)


def read_rows(files: ParquetFiles, positions: Sequence[int], columns: Sequence[str]) -> list[dict[str, Any]]:
    """The rows at global `positions` (in that order), `columns` of each, as Python values
    (`{column: value}`; a list column's value a list): what an export shows raw."""
    units = files.units()
    wanted = np.asarray(positions, dtype=np.int64)
    unit = np.searchsorted(units[:, 2], wanted, side="right") - 1
    rows: list[dict[str, Any]] = [{} for _ in positions]
    for u in np.unique(unit).tolist():
        file, group, first = (int(x) for x in units[u])
        table = files.read(file, group, list(dict.fromkeys(columns)))
        at = np.flatnonzero(unit == u)
        for i, row in zip(at.tolist(), table.take(pa.array(wanted[at] - first)).to_pylist()):
            rows[i] = row
    return rows
