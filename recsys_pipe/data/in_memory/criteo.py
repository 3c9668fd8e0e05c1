"""Criteo-format click data for DLRM: TSV files (`data=criteo`) and a learnable generator
(`data=criteo_synthetic`, the built-in default for DLRM: no download).

A row is `label`, 13 integer features and 26 categorical features, tab-separated: the layout of
the Kaggle display-advertising challenge's `train.txt` and of the Terabyte click logs' `day_N`
files. An integer may be empty (read as 0); a categorical value is a hexadecimal id, possibly
empty (read as 0). Categorical ids are hashed into `data.num_embeddings` buckets per feature
(`id % buckets`); integers become `sign(x) * log(1 + |x|)` (a few Criteo integers are small
negative numbers).

Why not `torchrec.datasets.criteo`: its readers cast malformed values silently to 0 and map
columns from the end of a row, so a short or corrupt row trains as wrong data instead of
failing; they report no line numbers; and its log transform shifts by the minimum over the whole
file, which needs a pass over all of it first. We use its column names (`int_<i>`, `cat_<i>`), and
this module imports no torchrec (a plain-torch DLRM trains on it where torchrec is not installed).

Rank `r` of `w` owns the contiguous rows `[N r / w, N (r + 1) / w)` of the file's N rows (at most
`data.max_rows`): it counts the file's line ends (a byte scan) and parses only its own lines,
through pyarrow (`recsys_pipe.data.text.criteo_tsv`), keeping them in memory. A malformed row stops the
rank that owns it with `<file>:<line>: <problem>`. For files larger than memory, convert them
(`recsys-data convert criteo`) and train with `data=parquet`, which streams.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, StrictInt, StrictStr, field_validator
from torch.utils.data import Dataset

from recsys_pipe.config import ConfigError, ConfigProblem, Section, builder_field
from recsys_pipe.data.batch import CriteoSample, DataSpec, collate_criteo
from recsys_pipe.data.ids import MAX_INPUT_HASH_SIZE, ManagedFeature, ManagedIds, raw_ids_problem, spread_ids
from recsys_pipe.data.preprocess import signed_log1p
from recsys_pipe.data.serving import id_record
from recsys_pipe.data.source import TabularDataConfig, readable_file
from recsys_pipe.data.text.criteo_tsv import (
    CATEGORICAL_KEYS,
    DENSE_NAMES,
    NUM_CATEGORICAL,
    NUM_DENSE,
    raw_criteo_rows,
    read_criteo,
)

__all__ = [
    "CATEGORICAL_KEYS",
    "CRITEO_ID_SPACE",
    "CriteoManagedIds",
    "DENSE_NAMES",
    "CriteoDataConfig",
    "CriteoDataset",
    "CriteoSyntheticConfig",
    "CriteoSyntheticDataConfig",
    "CriteoSyntheticDataset",
    "CriteoLayoutConfig",
    "criteo_dataset",
    "criteo_features",
    "criteo_synthetic_dataset",
    "read_criteo",
    "transform_dense",
]


def transform_dense(raw: np.ndarray) -> np.ndarray:
    """`sign(x) * log(1 + |x|)` as float32: compresses the heavy-tailed counts (the kernel an
    export's `preprocess.py` runs too: `recsys_pipe.data.preprocess.signed_log1p`)."""
    return signed_log1p(raw)


# -- configs --------------------------------------------------------------------------------------

#: Criteo's categorical values are 32-bit hexadecimal ids: the raw id space of `ids=managed`
CRITEO_ID_SPACE = 2**32


class CriteoManagedIds(ManagedIds):
    """`data.managed` of the Criteo layout: `ManagedIds` over Criteo's 32-bit id space."""

    input_hash_size: StrictInt = Field(
        CRITEO_ID_SPACE,
        ge=2,
        le=MAX_INPUT_HASH_SIZE,
        description="the raw id space [0, input_hash_size): Criteo's ids are 32-bit (2^32); integer ids outside "
        "it are refused; row-wise sharding gives each rank an equal slice of it",
    )


class CriteoLayoutConfig(TabularDataConfig):
    """Sources of Criteo-format rows (13 dense and 26 categorical features, one click label):
    `data=criteo`, `criteo_synthetic` and `parquet` without a column mapping."""

    num_embeddings: StrictInt | list[StrictInt] = Field(
        100_000,
        description="hash buckets (embedding rows) per categorical feature: one number for all 26, or a list of 26",
    )
    ids: Literal["modulo", "managed"] = Field(
        "modulo",
        description="how the categorical ids become rows: modulo (id % num_embeddings) or managed (the raw ids go to "
        "managed-collision tables of num_embeddings rows: data.managed, docs/raw-ids.md)",
    )
    managed: CriteoManagedIds = Field(
        default_factory=CriteoManagedIds, description="ids=managed: the eviction policy and the raw id space"
    )

    @field_validator("num_embeddings")
    @classmethod
    def _one_or_26(cls, value: int | list[int]) -> int | list[int]:
        sizes = [value] if isinstance(value, int) else value
        if isinstance(value, list) and len(value) != NUM_CATEGORICAL:
            raise ValueError(f"list {NUM_CATEGORICAL} bucket counts (one per categorical feature), got {len(value)}")
        if any(n < 1 for n in sizes):
            raise ValueError("bucket counts must be >= 1")
        return value

    def vocab_sizes(self) -> list[int]:
        """One vocabulary size per categorical feature: `num_embeddings` repeated, or the list it gives."""
        n = self.num_embeddings
        return [n] * NUM_CATEGORICAL if isinstance(n, int) else list(n)

    def spec(self) -> DataSpec:
        managed = ManagedFeature(self.managed, "data", "data.num_embeddings") if self.ids == "managed" else None
        return DataSpec(
            num_tasks=1,
            vocab_sizes=dict(zip(CATEGORICAL_KEYS, self.vocab_sizes())),
            num_dense=NUM_DENSE,
            managed={} if managed is None else dict.fromkeys(CATEGORICAL_KEYS, managed),
        )

    def row_ids(self, raw: np.ndarray) -> np.ndarray:
        """The categorical ids the batches carry for `raw` (`[N, 26]` non-negative ids): the rows
        (`id % num_embeddings`), or with `ids=managed` the raw ids themselves (checked to lie in
        the raw id space by the caller)."""
        if self.ids == "managed":
            return raw
        return raw % np.array(self.vocab_sizes(), dtype=np.int64)

    def id_records(self) -> list[dict[str, Any]]:
        """Each categorical feature's id mapping as `features.json` holds it (`id_record`)."""
        if self.ids == "managed":
            return [id_record("managed", n, input_hash_size=self.managed.input_hash_size) for n in self.vocab_sizes()]
        return [id_record("modulo", n) for n in self.vocab_sizes()]


class CriteoDataConfig(CriteoLayoutConfig):
    """`data=criteo`: a Criteo-format TSV file (`data.path`: Kaggle `train.txt`, Terabyte `day_N`)."""

    SIZE_KEY: ClassVar[str] = "data.path"

    name: Literal["criteo"] = "criteo"
    builder: StrictStr | None = builder_field("recsys_pipe.data.in_memory.criteo:criteo_dataset")
    path: StrictStr = Field(description="Criteo-format TSV: label, 13 integer, 26 hexadecimal categorical columns")
    max_rows: StrictInt | None = Field(
        None, ge=1, description="read at most this many rows from the start of the file (null: all)"
    )

    _readable_file = field_validator("path")(readable_file)


class CriteoSyntheticConfig(Section):
    """The generated click world (`data.synthetic.*`)."""

    num_samples: StrictInt = Field(1_000_000, ge=1, description="rows over all ranks")
    id_skew: float = Field(
        1.05, gt=0, description="id popularity: P(id k) ∝ (k+1)^-id_skew within each feature's buckets"
    )
    signal: float = Field(1.0, ge=0, description="scale of the learnable part of the click logit (0: pure noise)")


class CriteoSyntheticDataConfig(CriteoLayoutConfig):
    """`data=criteo_synthetic`: Criteo-like rows whose clicks depend on the features (learnable)."""

    SIZE_KEY: ClassVar[str] = "data.synthetic.num_samples"

    name: Literal["criteo_synthetic"] = "criteo_synthetic"
    builder: StrictStr | None = builder_field("recsys_pipe.data.in_memory.criteo:criteo_synthetic_dataset")
    synthetic: CriteoSyntheticConfig = Field(default_factory=CriteoSyntheticConfig, description="the generated world")


def criteo_features(id_records: list[dict[str, Any]], categorical: str) -> dict[str, Any]:
    """The Criteo layout's transforms (`ServedSource.serving_features`): each integer column
    `int_<i>` as `sign(x) * log(1 + |x|)` (empty: 0), each categorical column `cat_<i>` read as
    `categorical` (`hex` in a TSV file, `int` in Parquet; empty: 0) and mapped by its record of
    `id_records` (`CriteoLayoutConfig.id_records`: modulo its table's rows, or managed)."""
    features: dict[str, Any] = {
        name: {"column": name, "parse": "int", "missing": 0, "transform": {"kind": "signed_log1p"}}
        for name in DENSE_NAMES
    }
    for name, ids in zip(CATEGORICAL_KEYS, id_records):
        features[name] = {"column": name, "parse": categorical, "missing": 0, "ids": ids}
    return {"features": features, "params": {}, "inputs": {"dense_features": list(DENSE_NAMES)}}


# -- the file source ------------------------------------------------------------------------------


class CriteoDataset(Dataset[CriteoSample]):
    """This rank's rows of a Criteo TSV file, parsed and hashed once, kept in memory.

    Sample ids are the rows' 0-based positions in the file (unique over all ranks).
    """

    def __init__(self, cfg: CriteoDataConfig, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        dense, cats, labels, lines = read_criteo(cfg.path, rank, world_size, cfg.max_rows)
        if cfg.ids == "managed":
            bad = raw_ids_problem(cats.reshape(-1), cfg.managed.input_hash_size)
            if bad is not None:
                at, message = bad
                raise ConfigError(
                    ConfigProblem("data.path", f"{cfg.path}:{int(lines[at // NUM_CATEGORICAL])}: {message}")
                )
        self.dense = transform_dense(dense)
        self.ids = cfg.row_ids(cats)
        self.labels = labels
        self.sample_ids = lines - 1
        self.spec = cfg.spec()
        self.collate = collate_criteo
        self.path, self.id_records = cfg.path, cfg.id_records()

    def serving_features(self) -> dict[str, Any]:
        """The transforms of the file's columns (`recsys_pipe.data.serving.ServedSource`)."""
        return criteo_features(self.id_records, "hex")

    def raw_rows(self, sample_ids: Sequence[int], split: str | None) -> list[dict[str, Any]]:
        """The rows of `sample_ids` (0-based positions in the file) as the file holds them."""
        return raw_criteo_rows(self.path, [int(i) + 1 for i in sample_ids])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> CriteoSample:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.dense[index], self.ids[index], float(self.labels[index]), int(self.sample_ids[index])


def criteo_dataset(cfg: CriteoDataConfig, rank: int, world_size: int) -> CriteoDataset:
    """Builder of `data=criteo`."""
    return CriteoDataset(cfg, rank, world_size)


# -- the generated source -------------------------------------------------------------------------


class _ClickWorld:
    """The seed-determined ground truth of `criteo_synthetic`.

    Per integer feature j a log-normal count scale; per categorical feature f a Zipf id
    popularity over its buckets and a weight per id; two features also carry latent vectors
    whose dot product adds an interaction. The click logit is
    `-1 + signal * (0.7 * dense part + 1.5 * sparse part + 0.8 * interaction)`, each part of unit
    scale, so the clicks depend on single ids (what embeddings learn), on the integers (the dense
    MLP) and on a pair of features (the feature interaction).
    """

    def __init__(self, cfg: CriteoSyntheticDataConfig) -> None:
        rng = np.random.default_rng([cfg.seed, 0xC417E0])
        self.cfg = cfg
        self.signal = cfg.synthetic.signal
        self.vocab = cfg.vocab_sizes()
        self.dense_mu = rng.uniform(0.0, 3.0, NUM_DENSE)
        self.dense_weight = rng.normal(0.0, 1.0, NUM_DENSE) / math.sqrt(NUM_DENSE)
        self.id_weight = [rng.normal(0.0, 1.0, n).astype(np.float32) for n in self.vocab]
        self.latent = [rng.normal(0.0, 1.0, (self.vocab[f], 4)).astype(np.float32) / 2.0 for f in (0, 1)]
        cdfs: dict[int, np.ndarray] = {}
        for n in set(self.vocab):
            weights = np.arange(1, n + 1, dtype=np.float64) ** -cfg.synthetic.id_skew
            cdfs[n] = np.cumsum(weights) / weights.sum()
        self.id_cdf = [cdfs[n] for n in self.vocab]

    def sample(self, seed: int, index: int) -> CriteoSample:
        _, dense, ids, label = self.draw(seed, index)
        return dense, ids, label, index

    def draw(self, seed: int, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """Row `index`: its integer counts `[13]` raw and transformed, its ids `[26]` and click."""
        rng = np.random.default_rng([seed, index])
        u = rng.random(NUM_CATEGORICAL)
        ids = np.array(
            [min(int(np.searchsorted(cdf, x)), n - 1) for cdf, x, n in zip(self.id_cdf, u, self.vocab)], dtype=np.int64
        )
        counts = np.floor(np.exp(rng.normal(self.dense_mu, 1.0))) - 1.0
        dense = transform_dense(counts)
        dense_part = float(np.dot(self.dense_weight, dense - self.dense_mu))
        sparse_part = sum(float(w[i]) for w, i in zip(self.id_weight, ids)) / math.sqrt(NUM_CATEGORICAL)
        interaction = float(np.dot(self.latent[0][ids[0]], self.latent[1][ids[1]]))
        logit = -1.0 + self.signal * (0.7 * dense_part + 1.5 * sparse_part + 0.8 * interaction)
        label = float(rng.random() < 1.0 / (1.0 + math.exp(-logit)))
        return counts, dense, self.raw_ids(ids) if self.cfg.ids == "managed" else ids, label

    def raw_ids(self, ids: np.ndarray) -> np.ndarray:
        """With `ids=managed`, what feature f's generated id k is sent as (`spread_ids`, salted
        by the feature)."""
        return spread_ids(ids, np.arange(NUM_CATEGORICAL), self.cfg.managed.input_hash_size)


class CriteoSyntheticDataset(Dataset[CriteoSample]):
    """This rank's share of the generated rows: rank `r` of `w` owns global indices
    `r, r + w, ...`; each row comes from its own RNG seeded by `(data.seed, index)`, so a row is
    the same whatever the rank count, worker count or access order."""

    def __init__(self, cfg: CriteoSyntheticDataConfig, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.rank, self.world_size = rank, world_size
        self.num_samples = cfg.synthetic.num_samples
        self.seed = cfg.seed
        self._world = _ClickWorld(cfg)
        self.spec = cfg.spec()
        self.collate = collate_criteo
        self.id_records = cfg.id_records()

    def serving_features(self) -> dict[str, Any]:
        """The Criteo layout's transforms (`recsys_pipe.data.serving.ServedSource`)."""
        return criteo_features(self.id_records, "int")

    def raw_rows(self, sample_ids: Sequence[int], split: str | None) -> list[dict[str, Any]]:
        """The generated rows `sample_ids` (global indices) raw: counts and ids before the transform."""
        rows = []
        for index in sample_ids:
            counts, _, ids, label = self._world.draw(self.seed, int(index))
            row: dict[str, Any] = {"label": int(label)}
            row.update({k: int(v) for k, v in zip(DENSE_NAMES, counts)})
            row.update({k: int(v) for k, v in zip(CATEGORICAL_KEYS, ids)})
            rows.append(row)
        return rows

    def __len__(self) -> int:
        return self.num_samples // self.world_size

    def __getitem__(self, index: int) -> CriteoSample:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._world.sample(self.seed, index * self.world_size + self.rank)


def criteo_synthetic_dataset(cfg: CriteoSyntheticDataConfig, rank: int, world_size: int) -> CriteoSyntheticDataset:
    """Builder of `data=criteo_synthetic`."""
    return CriteoSyntheticDataset(cfg, rank, world_size)
