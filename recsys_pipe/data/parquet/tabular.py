"""`data=parquet`: tabular rows streamed from Parquet files (the DLRM family, or any model that
takes a KJT plus dense features and labels).

Without `data.columns` the files have the Criteo layout that `recsys-data convert criteo`
writes (`label`, `int_0..int_12`, `cat_0..cat_25`, integers) and the source takes
`data=criteo`'s keys: a file and its Parquet train bitwise the same (dense `sign(x)*log1p(|x|)`
as float32, ids `% data.num_embeddings`, a row's sample id its 0-based position over the files).
With `data.columns` any columns map to labels (one or several: a multi-task model), dense floats
and sparse features (an integer, string or list column each, with its own vocabulary size and
id mapping, `recsys_pipe.data.ids`).

How rows are shared, shuffled and resumed: `recsys_pipe.data.parquet.stream`. The reference of the keys:
docs/parquet.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field, StrictInt, StrictStr, field_validator

from recsys_pipe.config import ConfigError, ConfigProblem, Section, builder_field, home_expanded
from recsys_pipe.data.batch import CriteoBatch, DataSpec, TabularBatch
from recsys_pipe.data.ids import ManagedFeature, ManagedIds, managed_string_ids, raw_id_message, string_ids
from recsys_pipe.data.in_memory.criteo import CATEGORICAL_KEYS, DENSE_NAMES, CriteoLayoutConfig
from recsys_pipe.data.jagged import concat_ranges, offsets_of
from recsys_pipe.data.parquet.checks import RowProblems, list_column, null_rows
from recsys_pipe.data.parquet.files import Collected, DataFileError, ParquetFiles, RowGroupStats, open_parquet
from recsys_pipe.data.parquet.stream import Alloc, Fail, ReusedArrays, StreamSource, shared_empty
from recsys_pipe.data.preprocess import map_ids, signed_log1p_into
from recsys_pipe.data.serving import id_record

__all__ = [
    "ParquetDataConfig",
    "SparseColumn",
    "TabularColumns",
    "TabularDecoder",
    "TabularRows",
    "parquet_dataset",
]

IdMapping = Literal["as_is", "modulo", "hash", "managed"]


class SparseColumn(Section):
    """One sparse feature (`data.columns.sparse.<feature>`): its column and table."""

    column: StrictStr | None = Field(None, description="the column (null: the feature's name)")
    num_embeddings: StrictInt = Field(ge=1, description="rows of the feature's table (its vocabulary size)")
    ids: IdMapping = Field(
        "hash",
        description="how raw ids become rows: as_is (ids already in [0, num_embeddings), checked), modulo "
        "(id % num_embeddings, Criteo's rule; ids >= 0), hash (a stable 64-bit hash, any integer or string id) or "
        "managed (the raw id gets a row of its own while the eviction policy keeps it: `managed`, docs/raw-ids.md)",
    )
    managed: ManagedIds = Field(
        default_factory=ManagedIds, description="ids=managed: the eviction policy and the raw id space"
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
    builder: StrictStr | None = builder_field("recsys_pipe.data.parquet.tabular:parquet_dataset")
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
        return home_expanded(value)

    def spec(self) -> DataSpec:
        if self.columns is None:
            return super().spec()
        c = self.columns
        return DataSpec(
            num_tasks=len(c.labels),
            vocab_sizes={name: s.num_embeddings for name, s in c.sparse.items()},
            num_dense=len(c.dense),
            managed={
                name: ManagedFeature(s.managed, key, f"{key}.num_embeddings")
                for name, s in c.sparse.items()
                if s.ids == "managed"
                for key in [f"data.columns.sparse.{name}"]
            },
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
    #: `ids: managed`: the raw id space `[0, input_hash_size)`
    input_hash_size: int = 0

    @property
    def record(self) -> dict[str, Any]:
        """The feature's id mapping as `features.json` describes it (`recsys_pipe.data.preprocess`)."""
        if self.ids == "managed":
            return id_record(self.ids, self.num_embeddings, input_hash_size=self.input_hash_size)
        return id_record(self.ids, self.num_embeddings)


@dataclass
class TabularRows:
    """Decoded tabular rows: single-hot ids as a matrix, multi-hot ones as (values, offsets).

    With `order`, the rows are those of the tensors at the positions `order`, in that order: a
    window is decoded as it lies in its row groups, and the gather happens when batches are made
    (`batch`, `copy`), which copies them out of the window's tensors (module `stream`, "The
    hand-off"): in the main process, beside a worker that only decodes."""

    dense: torch.Tensor
    ids: torch.Tensor
    lists: list[tuple[torch.Tensor, torch.Tensor]]
    labels: torch.Tensor
    sample_ids: torch.Tensor
    layout: _Layout
    order: torch.Tensor | None = None

    def __len__(self) -> int:
        return int((self.sample_ids if self.order is None else self.order).numel())

    def slice(self, start: int, stop: int) -> TabularRows:
        if self.order is not None:
            return dataclasses.replace(self, order=self.order[start:stop])
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

    def copy(self) -> TabularRows:
        """These rows in tensors of their own (gathered in `order`)."""
        if self.order is None:
            lists = [(values.clone(), offsets.clone()) for values, offsets in self.lists]
            return TabularRows(
                self.dense.clone(),
                self.ids.clone(),
                lists,
                self.labels.clone(),
                self.sample_ids.clone(),
                self.layout,
            )
        order = self.order
        lists = []
        for values, offsets in self.lists:
            at = order.numpy()
            starts, lengths = offsets[:-1].numpy()[at], np.diff(offsets.numpy())[at]
            picked = values.numpy()[concat_ranges(starts, lengths)]
            lists.append((torch.from_numpy(picked), torch.from_numpy(offsets_of(lengths))))
        return TabularRows(
            self.dense.index_select(0, order),
            self.ids.index_select(0, order),
            lists,
            self.labels.index_select(0, order),
            self.sample_ids.index_select(0, order),
            self.layout,
        )

    @classmethod
    def concat(cls, parts: Sequence[TabularRows]) -> TabularRows:
        parts = [p.copy() if p.order is not None else p for p in parts]
        lists = []
        for k in range(len(parts[0].lists)):
            values = torch.cat([p.lists[k][0] for p in parts])
            lengths = torch.cat([p.lists[k][1][1:] - p.lists[k][1][:-1] for p in parts])
            lists.append((values, torch.from_numpy(offsets_of(lengths.numpy()))))
        return TabularRows(
            torch.cat([p.dense for p in parts]),
            torch.cat([p.ids for p in parts]),
            lists,
            torch.cat([p.labels for p in parts]),
            torch.cat([p.sample_ids for p in parts]),
            parts[0].layout,
        )

    def batch(self) -> CriteoBatch | TabularBatch:
        """These rows as a batch, in tensors of its own."""
        rows = self.copy()
        layout = self.layout
        if not rows.lists:
            return CriteoBatch(rows.dense, rows.ids, rows.labels, rows.sample_ids, layout.single_keys)
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        n = len(rows)
        values, lengths = [], []
        for key in layout.keys:
            if key in layout.single_index:
                values.append(rows.ids[:, layout.single_index[key]])
                lengths.append(torch.ones(n, dtype=torch.int32))
            else:
                v, offsets = rows.lists[layout.list_index[key]]
                values.append(v)
                lengths.append((offsets[1:] - offsets[:-1]).to(torch.int32))
        kjt = KeyedJaggedTensor(keys=list(layout.keys), values=torch.cat(values), lengths=torch.cat(lengths))
        return TabularBatch(rows.dense, kjt, rows.labels, rows.sample_ids)


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
        #: dense columns are read as int64 when all are integers, else as float64 (`_dense`)
        self.dense_integers = all(pa.types.is_integer(schema.field(name).type) for name in self.dense)
        # per table row: labels and dense float32, single-hot ids and its sample id int64; per
        # window row: its place in `order` (int64)
        self.row_bytes = 4 * len(self.labels) + 4 * len(self.dense) + 8 * len(self.single) + 16
        self._buffer = ReusedArrays()

    def _joined(self, n: int, dtype: Any) -> np.ndarray:
        return self._buffer("joined", n, dtype)

    def validate(self, table: pa.Table) -> RowProblems:
        """Every row `__call__` would refuse, check by check (`recsys_pipe.data.parquet.checks`)."""
        problems = RowProblems(table.num_rows)
        for name in [*self.labels, *self.dense, *(f.column for f in self.single)]:
            problems.add(name, null_rows(table.column(name)), "a null value")
        for name in self.labels:
            values = table.column(name).fill_null(0).to_numpy()
            problems.add(name, (values < 0) | (values > 1), lambda row, v=values: f"label {v[row]} outside [0, 1]")
        for f in self.single:
            if f.ids == "hash":  # any id (integer or string) has a row
                continue
            raw = _id_values(table.column(f.column).combine_chunks().fill_null(0), f)
            bad = _bad_ids(raw, f)
            if bad is not None:
                problems.add(f.column, bad, lambda row, v=raw, f=f: _id_message(int(v[row]), f))
        for f in self.multi:
            flat, offsets, null_lists = list_column(table.column(f.column))
            problems.add(f.column, null_lists, "a null list")
            nulls = np.asarray(flat.is_null()) if flat.null_count else np.zeros(len(flat), dtype=bool)
            problems.add_values(f.column, nulls, offsets, "a null id")
            if f.ids == "hash":
                continue
            raw = _id_values(flat.fill_null(0), f)
            bad = _bad_ids(raw, f)
            if bad is not None:
                problems.add_values(f.column, bad, offsets, lambda at, v=raw, f=f: _id_message(int(v[at]), f))
        return problems

    def serving_features(self) -> dict[str, Any]:
        """Each column's transform as this decoder applies it (`recsys_pipe.data.serving`)."""
        parse = "int" if self.dense_integers else "float"
        transform = {"kind": self.dense_transform}
        features: dict[str, Any] = {
            name: {"column": name, "parse": parse, "transform": transform} for name in self.dense
        }
        for f in [*self.single, *self.multi]:
            features[f.key] = {"column": f.column, "parse": "id", "ids": f.record}
        return {"features": features, "params": {}, "inputs": {"dense_features": list(self.dense)}}

    def __call__(
        self,
        table: pa.Table,
        sample_ids: np.ndarray,
        order: np.ndarray | None,
        fail: Fail,
        alloc: Alloc = shared_empty,
    ) -> TabularRows:
        """The table's rows as they lie (checked, ids mapped, dense features transformed), with
        `order` kept for the gather when batches are made (`TabularRows`)."""
        n = table.num_rows
        labels = alloc((n, len(self.labels)), torch.float32).numpy()
        for j, name in enumerate(self.labels):
            values = _numpy(table, name, fail, self._joined)
            if values.size and (values.min() < 0 or values.max() > 1):
                row = int(np.flatnonzero((values < 0) | (values > 1))[0])
                raise fail(name, f"label {values[row]} outside [0, 1]", row)
            labels[:, j] = values
        ids = alloc((n, len(self.single)), torch.int64).numpy()
        for j, f in enumerate(self.single):
            values = _ids(table, f, fail, self._joined)
            if f.ids != "hash":
                _check_ids(values, f, fail)
            if f.ids == "modulo":
                np.remainder(values, f.num_embeddings, out=ids[:, j])
            else:
                ids[:, j] = _map_ids(values, f)
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
            values = _id_values(flat, f)
            if f.ids != "hash":
                _check_ids(values, f, fail, offsets)
            mapped, shared_offsets = alloc((len(values),), torch.int64), alloc((n + 1,), torch.int64)
            mapped.numpy()[:] = _map_ids(values, f)
            shared_offsets.numpy()[:] = offsets
            lists.append((mapped, shared_offsets))
        positions = alloc((n,), torch.int64)
        positions.numpy()[:] = sample_ids
        picked = None
        if order is not None:
            picked = alloc((len(order),), torch.int64)
            picked.numpy()[:] = order
        return TabularRows(
            self._dense(table, n, alloc, fail),
            torch.from_numpy(ids),
            lists,
            torch.from_numpy(labels),
            positions,
            self.layout,
            picked,
        )

    def _dense(self, table: pa.Table, n: int, alloc: Alloc, fail: Fail) -> torch.Tensor:
        out = alloc((n, len(self.dense)), torch.float32)
        if not self.dense:
            return out
        array = out.numpy()
        # as `transform_dense` of the columns as one matrix: int64 if all are integers, else float64
        kind = np.int64 if self.dense_integers else np.float64
        raw = self._buffer("raw", n, kind)
        for j, name in enumerate(self.dense):
            raw[:] = _numpy(table, name, fail, self._joined)
            if self.dense_transform == "signed_log1p":  # data=criteo's own function: bitwise the same features
                same, wide = self._buffer("same", n, kind), self._buffer("wide", n, np.float64)
                signed_log1p_into(raw, array[:, j], same, wide)
            else:
                array[:, j] = raw
        return out


def _first_null(col: pa.Array) -> int:
    return int(np.flatnonzero(~np.asarray(col.is_valid()))[0])


Scratch = Callable[[int, Any], np.ndarray]
"""`scratch(n, dtype)`: a reused array that a column of several chunks is joined into."""


def _joined(chunks: list[np.ndarray], scratch: Scratch | None) -> np.ndarray:
    """One array of the chunks: the chunk itself if there is one (no copy), else joined (into
    `scratch`: a window that spans two row groups does not allocate per column)."""
    if len(chunks) == 1:
        return chunks[0]
    if scratch is None:
        return np.concatenate(chunks)
    return np.concatenate(chunks, out=scratch(sum(len(c) for c in chunks), chunks[0].dtype))


def _numpy(table: pa.Table, name: str, fail: Fail, scratch: Scratch | None = None) -> np.ndarray:
    """A numeric column as one numpy array (no copy for one chunk without nulls)."""
    col = table.column(name)
    if col.null_count:
        col = col.combine_chunks()
        raise fail(name, f"{col.null_count} null value(s)", _first_null(col))
    return _joined([c.to_numpy(zero_copy_only=False) for c in col.chunks], scratch)


def _id_values(col: pa.Array, f: _Feature) -> np.ndarray:
    """A column's ids as int64: integers as they are, strings hashed (`ids: hash` reads their
    64-bit FNV-1a; `ids: managed` that hash in its raw id space)."""
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_binary(col.type):
        return managed_string_ids(col, f.input_hash_size) if f.ids == "managed" else string_ids(col)
    return col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _ids(table: pa.Table, f: _Feature, fail: Fail, scratch: Scratch | None = None) -> np.ndarray:
    col = table.column(f.column)
    if col.null_count:
        col = col.combine_chunks()
        raise fail(f.column, f"{col.null_count} null id(s)", _first_null(col))
    return _joined([_id_values(c, f) for c in col.chunks], scratch)


def _bad_ids(values: np.ndarray, f: _Feature) -> np.ndarray | None:
    """Ids the feature's mapping refuses (negative, for `as_is` over the vocabulary, for `managed`
    outside the raw id space), or None."""
    if f.ids == "hash" or not values.size:
        return None
    if f.ids == "managed":
        if values.min() >= 0 and values.max() < f.input_hash_size:
            return None
        return (values < 0) | (values >= f.input_hash_size)
    if values.min() >= 0 and (f.ids != "as_is" or values.max() < f.num_embeddings):
        return None
    return values < 0 if f.ids == "modulo" else (values < 0) | (values >= f.num_embeddings)


def _id_message(value: int, f: _Feature) -> str:
    if f.ids == "managed":
        return raw_id_message(value, f.input_hash_size)
    if value < 0:
        return f"a negative id ({value}) with ids={f.ids}"
    return f"id {value} >= num_embeddings={f.num_embeddings} with ids=as_is (set ids: hash or modulo)"


def _check_ids(values: np.ndarray, f: _Feature, fail: Fail, offsets: np.ndarray | None = None) -> None:
    """The ids `_bad_ids` finds, the first named by its row."""
    bad = _bad_ids(values, f)
    if bad is not None:
        at = int(np.flatnonzero(bad)[0])
        row = at if offsets is None else int(np.searchsorted(offsets, at, side="right")) - 1
        raise fail(f.column, _id_message(int(values[at]), f), row)


def _map_ids(raw: np.ndarray, f: _Feature) -> np.ndarray:
    """Rows of the feature's table (`raw` checked by `_check_ids` unless hashed): the mapping an
    export's `preprocess.py` applies (`map_ids`), the checked modes without checking again; raw
    ids with `ids: managed` (the model's managed-collision tables give them rows)."""
    if f.ids == "hash":
        return map_ids(raw, f.record)
    if f.ids == "modulo":
        return raw % f.num_embeddings
    return raw


def _features(cfg: ParquetDataConfig) -> tuple[list[str], list[str], str, list[_Feature]]:
    c = cfg.columns
    if c is None:
        return (
            ["label"],
            list(DENSE_NAMES),
            "signed_log1p",
            [
                _Feature(k, k, n, cfg.ids, cfg.managed.input_hash_size)
                for k, n in zip(CATEGORICAL_KEYS, cfg.vocab_sizes())
            ],
        )
    features = [
        _Feature(name, s.column or name, s.num_embeddings, s.ids, s.managed.input_hash_size)
        for name, s in c.sparse.items()
    ]
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

    found = Collected()  # every missing or wrong column in one run
    for name in labels:
        with found:
            t = field_of(name).type
            if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
                raise DataFileError(key, files.where(0, column=name), f"a label column must be numeric, it is {t}")
    for name in dense:
        with found:
            t = field_of(name).type
            if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
                raise DataFileError(key, files.where(0, column=name), f"a dense column must be numeric, it is {t}")
    for f in features:
        with found:
            _check_sparse(files, key, f, field_of(f.column).type)
    found.raise_all()


def _check_sparse(files: ParquetFiles, key: str, f: _Feature, t: pa.DataType) -> None:
    inner = t.value_type if _is_list(t) else t
    strings = pa.types.is_string(inner) or pa.types.is_large_string(inner) or pa.types.is_binary(inner)
    if strings and f.ids not in ("hash", "managed"):
        raise DataFileError(
            key,
            files.where(0, column=f.column),
            f"string ids need ids: hash or managed (feature {f.key!r} has ids={f.ids})",
        )
    if not (pa.types.is_integer(inner) or strings):
        raise DataFileError(
            key,
            files.where(0, column=f.column),
            f"a sparse column must hold integer or string ids (or lists of them), it is {t}",
        )


def _stats_check(features: list[_Feature], labels: Sequence[str]) -> Any:
    """What the row groups' statistics show: nulls, labels outside [0, 1], negative ids, ids over
    the vocabulary."""
    by_column = {f.column: f for f in features}

    def check(files: ParquetFiles, file: int, group: int, stats: dict[str, RowGroupStats]) -> None:
        for name, st in stats.items():
            f = by_column.get(name)
            where = files.where(file, group, name)
            if st.null_count and not _is_list(files.schema.field(name).type):  # a list leaf counts empty lists
                raise DataFileError(files.key, where, f"{st.null_count} null value(s)")
            if name in labels and isinstance(st.min, (int, float)) and (st.min < 0 or st.max > 1):
                outside = st.min if st.min < 0 else st.max
                raise DataFileError(files.key, where, f"label {outside} outside [0, 1] (its statistics)")
            if f is None or f.ids == "hash" or not isinstance(st.min, int):
                continue
            if f.ids == "managed":
                outside = st.min if st.min < 0 else st.max if st.max >= f.input_hash_size else None
                if outside is not None:
                    raise DataFileError(files.key, where, raw_id_message(outside, f.input_hash_size))
                continue
            if st.min < 0:
                raise DataFileError(files.key, where, f"a negative id ({st.min}) with ids={f.ids}")
            if f.ids == "as_is" and st.max >= f.num_embeddings:
                raise DataFileError(
                    files.key,
                    where,
                    f"id {st.max} >= num_embeddings={f.num_embeddings} with ids=as_is (set ids: hash or modulo)",
                )

    return check


def _open_checked(
    path: Any, key: str, labels: list[str], dense: list[str], features: list[_Feature], mapped: bool, skip: bool
) -> ParquetFiles:
    """The files, their schema checked and (unless bad rows are skipped) their statistics."""
    return open_parquet(
        path,
        key,
        check_schema=lambda files: _check_schema(files, labels, dense, features, mapped),
        check_stats=None if skip else _stats_check(features, labels),
        stats_columns=[*labels, *(f.column for f in features)],
    )


def parquet_dataset(cfg: ParquetDataConfig, rank: int, world_size: int) -> StreamSource:
    """Builder of `data=parquet`: this rank's share of the files, checked from their metadata."""
    labels, dense, transform, features = _features(cfg)
    mapped = cfg.columns is not None
    skip = cfg.on_bad_row == "skip"  # the statistics' bad rows are then skipped as decoded
    files = _open_checked(cfg.path, "data.path", labels, dense, features, mapped, skip)
    eval_files = None
    if cfg.eval_path is not None:
        eval_files = _open_checked(cfg.eval_path, "data.eval_path", labels, dense, features, mapped, skip)
        if eval_files.schema.remove_metadata() != files.schema.remove_metadata():
            raise ConfigError(
                ConfigProblem("data.eval_path", f"{eval_files.where(0)}: a schema that differs from {files.where(0)}'s")
            )
    decoder = TabularDecoder(labels, dense, transform, features, files.schema)
    return StreamSource(files, decoder, rank, world_size, cfg, cfg.spec(), eval_files=eval_files, max_rows=cfg.max_rows)
