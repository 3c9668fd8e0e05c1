"""`data=parquet`: tabular rows streamed from Parquet files (the DLRM family, or any model that
takes a KJT plus dense features and labels).

Without `data.columns` the files have the Criteo layout that `recsys-data convert criteo`
writes (`label`, `int_0..int_12`, `cat_0..cat_25`, integers) and the source takes
`data=criteo`'s keys: a file and its Parquet train bitwise the same (dense `sign(x)*log1p(|x|)`
as float32, ids `% data.num_embeddings`, a row's sample id its 0-based position over the files).
With `data.columns` any columns map to labels (one or several: a multi-task model), dense floats
and sparse features (an integer, string or list column each, with its own vocabulary size and
id mapping, `recsys_pipe.data.ids`).

How rows are shared, shuffled and resumed: `recsys_pipe.data.stream`. The reference of the keys:
docs/parquet.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field, StrictInt, StrictStr, field_validator

from recsys_pipe.config import ConfigError, ConfigProblem, Section, builder_field
from recsys_pipe.data.criteo import CATEGORICAL_KEYS, DENSE_NAMES, CriteoBatch, CriteoLayoutConfig, transform_dense
from recsys_pipe.data.ids import splitmix64, string_ids
from recsys_pipe.data.parquet_files import DataFileError, ParquetFiles, open_parquet
from recsys_pipe.data.spec import DataSpec
from recsys_pipe.data.stream import Fail, StreamSource, shared_empty
from recsys_pipe.data.tabular import TabularBatch

__all__ = [
    "ParquetDataConfig",
    "SparseColumn",
    "TabularColumns",
    "TabularDecoder",
    "TabularRows",
    "parquet_dataset",
]

IdMapping = Literal["as_is", "modulo", "hash"]


class SparseColumn(Section):
    """One sparse feature (`data.columns.sparse.<feature>`): its column and table."""

    column: StrictStr | None = Field(None, description="the column (null: the feature's name)")
    num_embeddings: StrictInt = Field(ge=1, description="rows of the feature's table (its vocabulary size)")
    ids: IdMapping = Field(
        "hash",
        description="how raw ids become rows: as_is (ids already in [0, num_embeddings), checked), modulo "
        "(id % num_embeddings, Criteo's rule; ids >= 0) or hash (a stable 64-bit hash, any integer or string id)",
    )


class TabularColumns(Section):
    """The column mapping of `data=parquet` (`data.columns.*`)."""

    labels: list[StrictStr] = Field(
        default_factory=lambda: ["label"], min_length=1, description="label columns (several: one task each), 0..1"
    )
    dense: list[StrictStr] = Field(default_factory=list, description="dense feature columns (numbers)")
    dense_transform: Literal["none", "signed_log1p"] = Field(
        "none", description="applied to the dense columns: none, or sign(x) * log1p(|x|) (heavy-tailed counts)"
    )
    sparse: dict[StrictStr, SparseColumn] = Field(
        min_length=1,
        description="sparse features by name (the batches' KJT keys): an integer, string or list column each",
    )


class ParquetDataConfig(CriteoLayoutConfig):
    """`data=parquet`: tabular rows from Parquet files (see docs/parquet.md)."""

    SIZE_KEY: ClassVar[str] = "data.path"

    name: Literal["parquet"] = "parquet"
    builder: StrictStr | None = builder_field("recsys_pipe.data.parquet:parquet_dataset")
    path: StrictStr | list[StrictStr] = Field(
        description="Parquet file, directory, glob or URI (file://, s3://, gs://, hdfs://), or a list of them"
    )
    eval_path: StrictStr | list[StrictStr] | None = Field(
        None, description="evaluation files (null: hold out trainer.eval_batches batches from the tail of data.path)"
    )
    max_rows: StrictInt | None = Field(None, ge=1, description="use only the files' first rows (null: all)")
    shuffle_window: StrictInt = Field(
        65536, ge=1, description="rows shuffled together (rounded down to a multiple of data.batch_size)"
    )
    columns: TabularColumns | None = Field(
        None,
        description="column mapping (null: the Criteo layout of `recsys-data convert criteo`, data.num_embeddings)",
    )

    @field_validator("path", "eval_path")
    @classmethod
    def _names_files(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("an empty list names no file")
        return value

    def spec(self) -> DataSpec:
        if self.columns is None:
            return super().spec()
        c = self.columns
        return DataSpec(
            num_tasks=len(c.labels),
            vocab_sizes={name: s.num_embeddings for name, s in c.sparse.items()},
            num_dense=len(c.dense),
        )

    def multi_hot_features(self) -> list[str]:
        """The features mapped to list columns (read from the first file's footer; none if it
        cannot be read: the data checks name that problem)."""
        if self.columns is None:
            return []
        try:
            schema = open_parquet(self.path).schema
        except ConfigError:
            return []
        return [
            name
            for name, s in self.columns.sparse.items()
            if schema.get_field_index(s.column or name) >= 0 and _is_list(schema.field(s.column or name).type)
        ]


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


@dataclass(frozen=True)
class _Feature:
    key: str
    column: str
    num_embeddings: int
    ids: IdMapping


@dataclass
class TabularRows:
    """Decoded tabular rows: single-hot ids as a matrix, multi-hot ones as (values, offsets)."""

    dense: torch.Tensor
    ids: torch.Tensor
    lists: list[tuple[torch.Tensor, torch.Tensor]]
    labels: torch.Tensor
    sample_ids: torch.Tensor
    layout: _Layout

    def __len__(self) -> int:
        return int(self.sample_ids.numel())

    def slice(self, start: int, stop: int) -> TabularRows:
        lists = [
            (values[offsets[start] : offsets[stop]], offsets[start : stop + 1] - offsets[start])
            for values, offsets in self.lists
        ]
        return TabularRows(
            self.dense[start:stop],
            self.ids[start:stop],
            lists,
            self.labels[start:stop],
            self.sample_ids[start:stop],
            self.layout,
        )

    @classmethod
    def concat(cls, parts: Sequence[TabularRows]) -> TabularRows:
        lists = []
        for k in range(len(parts[0].lists)):
            values = torch.cat([p.lists[k][0] for p in parts])
            lengths = torch.cat([p.lists[k][1][1:] - p.lists[k][1][:-1] for p in parts])
            lists.append((values, _offsets(lengths)))
        return TabularRows(
            torch.cat([p.dense for p in parts]),
            torch.cat([p.ids for p in parts]),
            lists,
            torch.cat([p.labels for p in parts]),
            torch.cat([p.sample_ids for p in parts]),
            parts[0].layout,
        )

    def batch(self) -> CriteoBatch | TabularBatch:
        layout = self.layout
        if not self.lists:
            return CriteoBatch(self.dense, self.ids, self.labels, self.sample_ids, layout.single_keys)
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        n = len(self)
        values, lengths = [], []
        for key in layout.keys:
            if key in layout.single_index:
                values.append(self.ids[:, layout.single_index[key]])
                lengths.append(torch.ones(n, dtype=torch.int32))
            else:
                v, offsets = self.lists[layout.list_index[key]]
                values.append(v)
                lengths.append((offsets[1:] - offsets[:-1]).to(torch.int32))
        kjt = KeyedJaggedTensor(keys=list(layout.keys), values=torch.cat(values), lengths=torch.cat(lengths))
        return TabularBatch(self.dense, kjt, self.labels, self.sample_ids)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths.long(), 0, out=out[1:])
    return out


@dataclass(frozen=True)
class _Layout:
    keys: tuple[str, ...]
    single_keys: tuple[str, ...]
    single_index: dict[str, int] = field(hash=False)
    list_index: dict[str, int] = field(hash=False)


class TabularDecoder:
    """Turns a row group of a tabular Parquet file into `TabularRows` (vectorised), checking
    what its statistics could not show before the start (nulls, negative or too large ids)."""

    def __init__(
        self,
        labels: Sequence[str],
        dense: Sequence[str],
        dense_transform: str,
        features: Sequence[_Feature],
        schema: pa.Schema,
    ) -> None:
        self.labels, self.dense, self.dense_transform = list(labels), list(dense), dense_transform
        self.single = [f for f in features if not _is_list(schema.field(f.column).type)]
        self.multi = [f for f in features if _is_list(schema.field(f.column).type)]
        self.columns = list(dict.fromkeys([*self.labels, *self.dense, *(f.column for f in features)]))
        self.layout = _Layout(
            tuple(f.key for f in features),
            tuple(f.key for f in self.single),
            {f.key: i for i, f in enumerate(self.single)},
            {f.key: i for i, f in enumerate(self.multi)},
        )
        self._modulo = (
            np.array([f.num_embeddings for f in self.single], dtype=np.int64)
            if self.single and all(f.ids == "modulo" for f in self.single)
            else None
        )

    def __call__(self, table: pa.Table, sample_ids: np.ndarray, order: np.ndarray | None, fail: Fail) -> TabularRows:
        n = table.num_rows
        labels = _Matrix(n, len(self.labels), np.float32, order)
        for j, name in enumerate(self.labels):
            values = _numpy(table, name, fail)
            if values.size and (values.min() < 0 or values.max() > 1):
                raise fail(name, "a label outside [0, 1]", int(np.flatnonzero((values < 0) | (values > 1))[0]))
            labels.set(j, values)
        ids = _Matrix(n, len(self.single), np.int64, order)
        for j, f in enumerate(self.single):
            values = _ids(table, f, fail)
            if f.ids != "hash":
                _check_ids(values, f, fail)
            ids.set(j, values if self._modulo is not None else _map_ids(values, f))
        if self._modulo is not None:  # Criteo: one broadcast remainder over all features
            np.remainder(ids.array, self._modulo, out=ids.array)
        lists = []
        for f in self.multi:
            col = table.column(f.column).combine_chunks()
            if col.null_count:
                raise fail(f.column, f"{col.null_count} null list(s)", _first_null(col))
            offsets = np.asarray(col.offsets, dtype=np.int64)
            offsets = offsets - offsets[0]
            flat = col.flatten()
            if flat.null_count:
                row = int(np.searchsorted(offsets, _first_null(flat), side="right")) - 1
                raise fail(f.column, f"{flat.null_count} null id(s)", row)
            values = _id_values(flat)
            if f.ids != "hash":
                _check_ids(values, f, fail, offsets)
            values = _map_ids(values, f)
            if order is not None:
                lengths = np.diff(offsets)[order]
                values = values[_ranges(offsets[:-1][order], lengths)]
                offsets = _np_offsets(lengths)
            lists.append((torch.from_numpy(values), torch.from_numpy(offsets)))
        positions = _Matrix(n, 1, np.int64, order)
        positions.set(0, sample_ids)
        return TabularRows(
            self._dense(table, n, order, fail),
            ids.tensor(),
            lists,
            labels.tensor(),
            positions.tensor().reshape(-1),
            self.layout,
        )

    def _dense(self, table: pa.Table, n: int, order: np.ndarray | None, fail: Fail) -> torch.Tensor:
        out = _Matrix(n, len(self.dense), np.float32, order)
        if not self.dense:
            return out.tensor()
        cols = [_numpy(table, name, fail) for name in self.dense]
        integers = all(c.dtype.kind in "iu" for c in cols)
        raw = np.empty(out.array.shape, dtype=np.int64 if integers else np.float64)
        for j, c in enumerate(cols):
            raw[:, j] = c if order is None else c[order]
        if self.dense_transform == "signed_log1p":
            out.array[:] = transform_dense(raw)  # data=criteo's own function: bitwise the same features
        else:
            out.array[:] = raw
        return out.tensor()


class _Matrix:
    """A `[rows, width]` block of the window's rows in `order`, filled column by column (each
    column gathered on its own: contiguous reads, much faster than a row gather of the block),
    in shared memory inside a worker (`shared_empty`)."""

    def __init__(self, rows: int, width: int, dtype: type, order: np.ndarray | None) -> None:
        self.order = order
        torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        self._tensor = shared_empty((rows if order is None else len(order), width), torch_dtype)
        self.array = self._tensor.numpy()

    def set(self, column: int, values: np.ndarray) -> None:
        self.array[:, column] = values if self.order is None else values[self.order]

    def tensor(self) -> torch.Tensor:
        return self._tensor


def _first_null(col: pa.Array) -> int:
    return int(np.flatnonzero(~np.asarray(col.is_valid()))[0])


def _numpy(table: pa.Table, name: str, fail: Fail) -> np.ndarray:
    """A numeric column as one numpy array (no copy for one chunk without nulls)."""
    col = table.column(name)
    if col.null_count:
        col = col.combine_chunks()
        raise fail(name, f"{col.null_count} null value(s)", _first_null(col))
    if col.num_chunks == 1:
        return col.chunk(0).to_numpy(zero_copy_only=False)
    return np.concatenate([c.to_numpy(zero_copy_only=False) for c in col.chunks])


def _id_values(col: pa.Array) -> np.ndarray:
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_binary(col.type):
        return string_ids(col)
    return col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _ids(table: pa.Table, f: _Feature, fail: Fail) -> np.ndarray:
    col = table.column(f.column)
    if col.null_count:
        col = col.combine_chunks()
        raise fail(f.column, f"{col.null_count} null id(s)", _first_null(col))
    if col.num_chunks == 1:
        return _id_values(col.chunk(0))
    return np.concatenate([_id_values(c) for c in col.chunks])


def _check_ids(values: np.ndarray, f: _Feature, fail: Fail, offsets: np.ndarray | None = None) -> None:
    """Negative ids (modulo, as_is) and ids over the vocabulary (as_is), named by their row."""
    bad = values < 0 if f.ids == "modulo" else (values < 0) | (values >= f.num_embeddings)
    if values.size and (values.min() < 0 or (f.ids == "as_is" and values.max() >= f.num_embeddings)):
        at = int(np.flatnonzero(bad)[0])
        row = at if offsets is None else int(np.searchsorted(offsets, at, side="right")) - 1
        value = int(values[at])
        if value < 0:
            raise fail(f.column, f"a negative id ({value}) with ids={f.ids}", row)
        raise fail(
            f.column, f"id {value} >= num_embeddings={f.num_embeddings} with ids=as_is (set ids: hash or modulo)", row
        )


def _map_ids(raw: np.ndarray, f: _Feature) -> np.ndarray:
    """Rows of the feature's table (`raw` checked by `_check_ids` unless hashed)."""
    if f.ids == "hash":
        return (splitmix64(raw) % np.uint64(f.num_embeddings)).astype(np.int64)
    if f.ids == "modulo":
        return raw % f.num_embeddings
    return raw


def _np_offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of `arange(s, s + n)` per start and length, vectorised."""
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    row = np.repeat(np.arange(len(lengths)), lengths)
    return starts[row] + (np.arange(total) - _np_offsets(lengths)[row])


def _features(cfg: ParquetDataConfig) -> tuple[list[str], list[str], str, list[_Feature]]:
    c = cfg.columns
    if c is None:
        return (
            ["label"],
            list(DENSE_NAMES),
            "signed_log1p",
            [_Feature(k, k, n, "modulo") for k, n in zip(CATEGORICAL_KEYS, cfg.vocab_sizes())],
        )
    features = [_Feature(name, s.column or name, s.num_embeddings, s.ids) for name, s in c.sparse.items()]
    return list(c.labels), list(c.dense), c.dense_transform, features


def _check_schema(
    files: ParquetFiles, labels: list[str], dense: list[str], features: list[_Feature], mapped: bool
) -> None:
    """Missing columns and wrong types, before the start (the schema is the same in every file)."""
    schema = files.schema
    key = "data.columns" if mapped else "data.path"
    hint = (
        "" if mapped else " (data=parquet without data.columns reads the Criteo layout of `recsys-data convert criteo`)"
    )

    def field_of(name: str) -> pa.Field:
        i = schema.get_field_index(name)
        if i < 0:
            raise DataFileError(key, files.where(0), f"no column {name!r}{hint}; it has {schema.names}")
        return schema.field(i)

    for name in labels:
        t = field_of(name).type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
            raise DataFileError(key, files.where(0, column=name), f"a label column must be numeric, it is {t}")
    for name in dense:
        t = field_of(name).type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
            raise DataFileError(key, files.where(0, column=name), f"a dense column must be numeric, it is {t}")
    for f in features:
        t = field_of(f.column).type
        inner = t.value_type if _is_list(t) else t
        strings = pa.types.is_string(inner) or pa.types.is_large_string(inner) or pa.types.is_binary(inner)
        if strings and f.ids != "hash":
            raise DataFileError(
                key, files.where(0, column=f.column), f"string ids need ids: hash (feature {f.key!r} has ids={f.ids})"
            )
        if not (pa.types.is_integer(inner) or strings):
            raise DataFileError(
                key,
                files.where(0, column=f.column),
                f"a sparse column must hold integer or string ids (or lists of them), it is {t}",
            )


def _check_stats(files: ParquetFiles, labels: list[str], features: list[_Feature]) -> None:
    """What the row groups' statistics show: nulls, negative ids, ids over the vocabulary."""
    by_column = {f.column: f for f in features}
    for (file, group), columns in files.stats.items():
        for name, st in columns.items():
            f = by_column.get(name)
            is_list = _is_list(files.schema.field(name).type)
            if st.null_count and not is_list:  # a list leaf counts empty lists as nulls
                raise DataFileError("data.path", files.where(file, group, name), f"{st.null_count} null value(s)")
            if f is None or f.ids == "hash" or not isinstance(st.min, int):
                continue
            if st.min < 0:
                raise DataFileError(
                    "data.path", files.where(file, group, name), f"a negative id ({st.min}) with ids={f.ids}"
                )
            if f.ids == "as_is" and st.max >= f.num_embeddings:
                raise DataFileError(
                    "data.path",
                    files.where(file, group, name),
                    f"id {st.max} >= num_embeddings={f.num_embeddings} with ids=as_is (set ids: hash or modulo)",
                )


def _open_checked(
    path: Any, key: str, labels: list[str], dense: list[str], features: list[_Feature], mapped: bool
) -> ParquetFiles:
    files = open_parquet(path, key, stats_columns=[*labels, *(f.column for f in features)])
    _check_schema(files, labels, dense, features, mapped)
    if key != "data.path":
        files.key = key
    _check_stats(files, labels, features)
    return files


def parquet_dataset(cfg: ParquetDataConfig, rank: int, world_size: int) -> StreamSource:
    """Builder of `data=parquet`: this rank's share of the files, checked from their metadata."""
    labels, dense, transform, features = _features(cfg)
    mapped = cfg.columns is not None
    files = _open_checked(cfg.path, "data.path", labels, dense, features, mapped)
    eval_files = None
    if cfg.eval_path is not None:
        eval_files = _open_checked(cfg.eval_path, "data.eval_path", labels, dense, features, mapped)
        if eval_files.schema.remove_metadata() != files.schema.remove_metadata():
            raise ConfigError(
                ConfigProblem("data.eval_path", f"{eval_files.where(0)}: a schema that differs from {files.where(0)}'s")
            )
    decoder = TabularDecoder(labels, dense, transform, features, files.schema)
    return StreamSource(files, decoder, rank, world_size, cfg, cfg.spec(), eval_files=eval_files, max_rows=cfg.max_rows)
