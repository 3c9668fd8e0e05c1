"""What a data source tells an export: how each input is transformed, and held-out rows raw.

A served model needs inputs made as training made them. Every shipped source describes its
features (`ServedSource.serving_features`: one record per feature, as `features.json` holds it;
`recsys_pipe.data.preprocess` applies them) and gives back the rows of a batch as its files hold
them (`ServedSource.raw_rows`: `raw_example.jsonl`). The records come from the same objects the
source's decoders use (a Parquet feature's id mapping is its `_Feature.record`), so the
description is the data config's, not a copy of it.

Sequence sources describe their rows with the column names of the Parquet layout `recsys-data
convert sequences` writes (`user_id`, `item_ids`, `timestamps`, `actions`; `data.columns.*` for
Parquet files), whatever file they read: a text file's rows are what its conversion would hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.data import preprocess

__all__ = [
    "ACTION_IDS",
    "FEATURES_FORMAT",
    "RATING_ACTIONS",
    "SEQUENCE_COLUMNS",
    "ServedSource",
    "id_record",
    "preprocess_file",
    "retrieval_features",
    "retrieval_row",
    "served_source",
    "sequence_features",
]

#: the format `features.json` declares (`recsys_pipe.data.preprocess.FORMAT`)
FEATURES_FORMAT = preprocess.FORMAT


def preprocess_file() -> Path:
    """The file an export copies as its `preprocess.py` (`recsys_pipe.data.preprocess`)."""
    return Path(preprocess.__file__)


#: the columns of a sequence row (the Parquet layout `recsys-data convert sequences` writes)
SEQUENCE_COLUMNS = {"user": "user_id", "items": "item_ids", "timestamps": "timestamps", "actions": "actions"}
#: a rating's action id, `round(2 * rating)` (halves to even: `numpy.rint`, as Python's `round`)
RATING_ACTIONS = {"parse": "float", "transform": {"kind": "scaled_round", "scale": 2.0}}
#: action ids as they are (generated data)
ACTION_IDS = {"parse": "int", "transform": {"kind": "none"}}
#: the row key of the time of the item to come (a retrieval request's time), and of a ranking
#: row's candidate count (default: the data's `num_candidates`)
NEXT_TIMESTAMP, NUM_CANDIDATES = "next_timestamp", "num_candidates"


def id_record(
    mapping: str,
    num_embeddings: int,
    values: Sequence[Any] | np.ndarray | None = None,
    input_hash_size: int | None = None,
) -> dict[str, Any]:
    """An id mapping as `features.json` holds it (`recsys_pipe.data.preprocess.ID_MAPPINGS`):
    `values` of a vocabulary, `input_hash_size` of managed ids (and, for a retrieval source's
    items, `values`: the catalogue the item table scores, as the files hold the ids)."""
    record: dict[str, Any] = {"mapping": mapping, "num_embeddings": int(num_embeddings)}
    if mapping == "hash":
        record.update(function="splitmix64", seed=0, strings="fnv1a64")
    if mapping == "vocabulary":
        record["values"] = np.asarray(values).tolist()
    if mapping == "managed":
        record.update(input_hash_size=int(input_hash_size or 0), strings="fnv1a64")
        if values is not None:
            record["catalogue"] = np.asarray(values).tolist()
    return record


@runtime_checkable
class ServedSource(Protocol):
    """A data source an export can describe (every shipped one)."""

    def serving_features(self) -> dict[str, Any]:
        """`{"features": {name: record}, "params": {...}}`: each feature's column and transform
        (`recsys_pipe.data.preprocess`), and the sizes of a sample (`max_seq_len`, ...)."""
        ...

    def raw_rows(self, sample_ids: Sequence[int], split: str | None) -> list[dict[str, Any]]:
        """The samples `sample_ids` (of a batch; of evaluation split `split` for a retrieval
        source) as raw rows, `{column: value}` as the files hold them."""
        ...


def served_source(dataset: Any, key: str = "data.name") -> ServedSource:
    """`dataset` as a `ServedSource`, or a ConfigError for a source of the user's own that does
    not describe its features."""
    if isinstance(dataset, ServedSource):
        return dataset
    raise ConfigError(
        ConfigProblem(
            key,
            f"the data source ({type(dataset).__name__}) does not describe its features for serving: give it "
            "`serving_features()` and `raw_rows(sample_ids, split)` (recsys_pipe.data.serving.ServedSource)",
        )
    )


def _timestamps(has_timestamps: bool, column: str | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {"column": column or SEQUENCE_COLUMNS["timestamps"], "parse": "int"}
    if not has_timestamps:
        record["missing"] = "position"  # the position in the row stands in for time
    return record


def retrieval_features(
    items: dict[str, Any], has_timestamps: bool, max_seq_len: int, columns: dict[str, str] | None = None
) -> dict[str, Any]:
    """The description of a retrieval source: its items' id mapping (`items`: an `id_record`) and
    how many of a user's most recent items a sample keeps."""
    cols = {**SEQUENCE_COLUMNS, **(columns or {})}
    return {
        "features": {
            "item": {"column": cols["items"], "parse": "id", "ids": items},
            "timestamp": _timestamps(has_timestamps, cols["timestamps"]),
        },
        "params": {"history": int(max_seq_len), "next_timestamp_column": NEXT_TIMESTAMP},
    }


def retrieval_row(
    user: Any,
    items: Sequence[Any],
    stamps: Sequence[int],
    split: str | None,
    has_timestamps: bool,
    columns: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A user's raw row cut before the held-out item of `split` (valid: the second to last item;
    test: the last), with the time of that item as `next_timestamp` (the request's time)."""
    cols = {**SEQUENCE_COLUMNS, **(columns or {})}
    end = len(items) - (2 if split == "valid" else 1)
    row: dict[str, Any] = {cols["user"]: user, cols["items"]: list(items[:end])}
    if has_timestamps:
        row[cols["timestamps"]] = [int(t) for t in stamps[:end]]
    row[NEXT_TIMESTAMP] = int(stamps[end]) if has_timestamps else end
    return row


def sequence_features(
    items: dict[str, Any],
    actions: dict[str, Any],
    has_timestamps: bool,
    max_seq_len: int,
    num_candidates: int,
    users: dict[str, Any] | None,
    columns: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The description of an HSTU ranking source: a row's events (history, then its last
    `num_candidates` as candidates), of which a sample keeps the last `max_seq_len`; `actions`: the
    record of the `actions` column (how a cell is read and made an action id: ratings through
    `RATING_ACTIONS`); `users`: the user id mapping, if used."""
    cols = {**SEQUENCE_COLUMNS, **(columns or {})}
    features: dict[str, Any] = {
        "item": {"column": cols["items"], "parse": "id", "ids": items},
        "action": {"column": cols["actions"], **actions},
        "timestamp": _timestamps(has_timestamps, cols["timestamps"]),
    }
    if users is not None:
        features["user"] = {"column": cols["user"], "parse": "id", "ids": users}
    params = {"history": int(max_seq_len), "num_candidates": int(num_candidates), "candidates_column": NUM_CANDIDATES}
    return {"features": features, "params": params}
