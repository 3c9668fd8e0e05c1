"""Ids of sparse features mapped into a table's `[0, n)` rows, vectorised and stable.

`hash` mode gives every raw id the same row on every run and machine: a raw 64-bit integer is
mixed with SplitMix64's finaliser (Steele, Lea & Flood 2014; the same constants everywhere), a
string is first folded to 64 bits with FNV-1a over its UTF-8 bytes; the row is the mixed value
modulo `n`. Both are fixed arithmetic on uint64 (numpy wraps around), never Python's `hash`,
which is salted per process. Python's `hashlib` would be as stable but works one value at a time;
these run over whole columns.

The kernels live in `recsys_pipe.data.preprocess`, the file an export ships for serving: training
and serving hash with the same code. This module reads Arrow's string buffers into them.

`managed` mode does not map ids to rows here: the source passes each raw id on and the model's
managed-collision tables (torchrec's `MCHManagedCollisionModule`, `recsys_pipe.models.managed`)
give it a row of its own while it is frequent or recent enough (`ManagedIds`). Here the raw id
only has to lie in the id space the tables split over the ranks, `[0, input_hash_size)`: an
integer id outside it is refused (`raw_ids_problem`), a string id is hashed into it
(`managed_string_ids`: FNV-1a, then the remainder).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, StrictInt

from recsys_pipe.config import ConfigError, ConfigProblem, Section
from recsys_pipe.data.preprocess import fnv1a64 as _fnv1a64_bytes
from recsys_pipe.data.preprocess import raw_id_message, splitmix64, splitmix64_inplace

if TYPE_CHECKING:
    from recsys_pipe.data.batch import DataSpec

__all__ = [
    "EVICTION_POLICIES",
    "MAX_INPUT_HASH_SIZE",
    "ManagedColumn",
    "ManagedFeature",
    "ManagedIds",
    "SequenceIds",
    "catalogue_raw_ids",
    "fnv1a64",
    "managed_string_ids",
    "raw_id_message",
    "raw_ids_problem",
    "spread_ids",
    "splitmix64",
    "splitmix64_inplace",
    "string_ids",
]


#: the eviction policies of `ids: managed` (torchrec's LFU, LRU and distance-LFU)
EVICTION_POLICIES = ("lfu", "lru", "distance_lfu")
#: the largest raw id space: every non-negative int64
MAX_INPUT_HASH_SIZE = 2**63 - 1


class ManagedIds(Section):
    """How `ids: managed` gives raw ids their rows (`<feature>.managed.*`; docs/raw-ids.md).

    The table's rows hold the raw ids the eviction policy keeps: every `eviction_interval`
    training steps the ids seen since the last eviction compete with the ids in the table, and
    the policy's lowest-scored ones leave (their rows are re-initialised for the newcomers). An
    id without a row (new, or evicted) is looked up in the table's last row, which every such
    id shares until it wins one of its own."""

    eviction_policy: Literal["lfu", "lru", "distance_lfu"] = Field(
        "lfu",
        description="which ids keep their rows: lfu (the most frequent since admitted), lru (the most recently "
        "seen), distance_lfu (frequency divided by the steps since last seen)",
    )
    eviction_interval: StrictInt = Field(
        10,
        ge=1,
        description="training steps between evictions (new ids wait for the next one in the shared row; each "
        "eviction sorts the table: docs/raw-ids.md has the trade-off measured)",
    )
    input_hash_size: StrictInt = Field(
        MAX_INPUT_HASH_SIZE,
        ge=2,
        le=MAX_INPUT_HASH_SIZE,
        description="the raw id space [0, input_hash_size): integer ids outside it are refused, string ids are "
        "hashed into it; row-wise sharding gives each rank an equal slice of it",
    )


@dataclass(frozen=True)
class ManagedFeature:
    """A feature with `ids: managed`, as the data tells the model (`DataSpec.managed`): its
    settings, `key`, the config path of its mapping (`data.columns.sparse.<feature>`, or `data`
    for a source's own features), and `rows_key`, the config path of its table's rows; its
    problems are reported there. A feature that is not `counted` is looked up without counting
    its ids for eviction (the retrieval models' sampled negatives share the item table)."""

    ids: ManagedIds
    key: str
    rows_key: str
    counted: bool = True

    def problem_key(self, name: str) -> str:
        """The config path of the mapping's key `name` (`ids`, `managed.input_hash_size`)."""
        return f"{self.key}.{name}"


def fnv1a64(strings: pa.Array) -> np.ndarray:
    """FNV-1a (64-bit) of each string's UTF-8 bytes, column-wise, read from the Arrow buffers."""
    strings = pc.cast(strings, pa.large_binary())
    n = len(strings)
    offsets = np.frombuffer(strings.buffers()[1], dtype=np.int64)[strings.offset : strings.offset + n + 1]
    data = (
        np.frombuffer(strings.buffers()[2], dtype=np.uint8)
        if strings.buffers()[2] is not None
        else np.zeros(0, np.uint8)
    )
    return _fnv1a64_bytes(data, offsets)


def string_ids(strings: pa.Array) -> np.ndarray:
    """Stable 64-bit ids of strings (FNV-1a), as int64 bit patterns."""
    return fnv1a64(strings).view(np.int64)


class SequenceIds(Section):
    """How a sequence source's item and user ids become rows (`data.ids`, `data.managed`,
    `data.item_rows`, `data.user_rows`)."""

    ids: Literal["vocabulary", "managed"] = Field(
        "vocabulary",
        description="vocabulary: the source's dense ids (each distinct item/user its row); managed: the raw ids go "
        "to managed-collision tables (data.managed, data.item_rows, data.user_rows; docs/raw-ids.md)",
    )
    managed: ManagedIds = Field(
        default_factory=ManagedIds, description="ids=managed: the eviction policy and the raw id space"
    )
    item_rows: StrictInt | None = Field(
        None, ge=2, description="ids=managed: rows of the item table (null: as many as the source has items)"
    )
    user_rows: StrictInt | None = Field(
        None, ge=2, description="ids=managed: rows of the user table (null: as many as the source has users)"
    )

    def managed_features(
        self, rows_keys: Mapping[str, str], uncounted: tuple[str, ...] = ()
    ) -> dict[str, ManagedFeature]:
        """`DataSpec.managed` for the source's id features (items, users; each with the config
        path of its rows; those of `uncounted` looked up without counting): all or none."""
        if self.ids != "managed":
            return {}
        return {f: ManagedFeature(self.managed, "data", key, f not in uncounted) for f, key in rows_keys.items()}

    def table_rows(self, vocabulary: int, which: Literal["item", "user"]) -> int:
        """Rows of the item or user table: the source's `vocabulary`, or with `ids=managed` the
        `item_rows` / `user_rows` given."""
        rows = self.item_rows if which == "item" else self.user_rows
        return rows if self.ids == "managed" and rows is not None else vocabulary

    def retrieval_spec(self, num_items: int) -> DataSpec:
        """The spec of a next-item retrieval source of `num_items` items: its one item table
        (with `ids=managed`, of `data.item_rows` rows, null: `num_items`, whose ids are counted
        for eviction where they are the users' own, inputs and targets; the sampled negatives,
        the candidates and the catalogue are looked up without counting)."""
        from recsys_pipe.data.batch import CAND_KEY, CATALOG_KEY, INPUT_KEY, NEG_KEY, RETRIEVAL_KEYS, DataSpec

        if self.user_rows is not None:
            raise ConfigError(
                ConfigProblem(
                    "data.user_rows",
                    "the retrieval models have no user table (a user is their item sequence); leave it null",
                )
            )
        managed = self.managed_features(
            dict.fromkeys(RETRIEVAL_KEYS, "data.item_rows"), (NEG_KEY, CAND_KEY, CATALOG_KEY)
        )
        return DataSpec(num_tasks=1, vocab_sizes={INPUT_KEY: self.table_rows(num_items, "item")}, managed=managed)

    def managed_column(self, names: list[str] | None, which: Literal["item", "user"]) -> ManagedColumn | None:
        """With `ids=managed`, how a file's `which` id column gives raw ids (`ManagedColumn`;
        `names`: the texts of ids a converter numbered); else None."""
        return ManagedColumn(self.managed.input_hash_size, names, which) if self.ids == "managed" else None


def catalogue_raw_ids(items: Sequence[Any], input_hash_size: int) -> np.ndarray:
    """The raw ids (`ids: managed`) of a source's items as it read them: strings hashed into the
    space (`managed_string_ids`), integers as they are (a ValueError naming the first outside it)."""
    if items and isinstance(items[0], str):
        return managed_string_ids(pa.array(items, pa.string()), input_hash_size)
    values = np.asarray(items, dtype=np.int64)
    problem = raw_ids_problem(values, input_hash_size)
    if problem is not None:
        raise ValueError(f"item: {problem[1]}")
    return values


def managed_string_ids(strings: pa.Array, input_hash_size: int) -> np.ndarray:
    """Raw ids of strings for `ids: managed`: their FNV-1a hash (`fnv1a64`, as `ids: hash` reads
    strings) reduced into `[0, input_hash_size)`, int64."""
    return (fnv1a64(strings) % np.uint64(input_hash_size)).astype(np.int64)


@dataclass(frozen=True)
class ManagedColumn:
    """How `ids: managed` reads an integer id column whose ids a converter may have numbered
    (`recsys-data convert sequences` numbers text ids and stores their texts): an integer raw id
    as it is, in `[0, input_hash_size)`; a numbered text id as its text's raw id
    (`managed_string_ids`, as the tabular sources and an export's `preprocess.py` hash strings).
    `names`: the texts in the order of their numbers (None: the ids are the raw ids)."""

    input_hash_size: int
    names: list[str] | None = None
    #: what the ids are, for messages ("item", "user")
    what: str = "id"

    @cached_property
    def hashed(self) -> np.ndarray | None:
        """The raw id of each numbered text (None without texts), computed once."""
        if self.names is None:
            return None
        return managed_string_ids(pa.array(self.names, pa.string()), self.input_hash_size)

    def unknown(self, values: np.ndarray) -> np.ndarray:
        """Which of `values` the column cannot read: outside the raw id space, or numbers no text has."""
        bound = self.input_hash_size if self.names is None else len(self.names)
        return (values < 0) | (values >= bound)

    def message(self, value: int) -> str:
        """Why `value` (one of `unknown`) is refused."""
        if self.names is None:
            return f"{self.what}: {raw_id_message(value, self.input_hash_size)}"
        return f"{self.what} id {value} has no stored text (the converter numbered {len(self.names)} text ids)"

    def raw_ids(self, values: np.ndarray) -> np.ndarray:
        """The raw ids of `values` (int64, checked with `unknown` first)."""
        hashed = self.hashed
        return values if hashed is None else hashed[values]


def raw_ids_problem(values: np.ndarray, input_hash_size: int) -> tuple[int, str] | None:
    """The first integer id of `values` outside `[0, input_hash_size)` (`ids: managed`) as
    (its position, what is wrong), or None when every id lies in it."""
    if not values.size or (values.min() >= 0 and values.max() < input_hash_size):
        return None
    at = int(np.flatnonzero((values < 0) | (values >= input_hash_size))[0])
    return at, raw_id_message(int(values[at]), input_hash_size)


def spread_ids(ids: np.ndarray, salt: int | np.ndarray, input_hash_size: int) -> np.ndarray:
    """Raw ids that a generated source sends for its dense `ids` (non-negative, below 2^40) with
    `ids: managed`: SplitMix64 of `salt * 2^40 + id` reduced into `[0, input_hash_size)`, spread
    over the raw id space as real ids are (row-wise shards each get their share). A different
    `salt` per feature keeps features' raw ids apart (an array: one per id)."""
    keys = np.asarray(ids, dtype=np.int64) + (np.asarray(salt, dtype=np.int64) << np.int64(40))
    return (splitmix64(keys) % np.uint64(input_hash_size)).astype(np.int64)
