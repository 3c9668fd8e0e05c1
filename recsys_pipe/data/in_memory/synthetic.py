"""Synthetic sequential-recommendation data with structure a model can learn.

The world (fixed by the seed, identical on every rank): users belong to clusters; every item
has a home cluster; each cluster has its own item-transition chain (a permutation of the items),
and the probability of each engagement task (e.g. click, like) depends on the user's cluster,
the item's home cluster and a per-item quality. A user's history therefore reveals the cluster
(which items and which actions), and the cluster plus the candidate item determine the labels:
loss falls and AUC rises well above 0.5 when a sequence model trains on it.

Every sample is generated from its own RNG seeded by `(seed, global index)`, so a sample is the
same whatever the rank count, worker count or access order; rank `r` of `w` owns global
indices `r, r + w, r + 2w, ...` (disjoint across ranks, equal counts on all ranks).

Sequence lengths (`data.synthetic.length_distribution`): `uniform` in `[min_seq_len, max_seq_len]`,
`fixed` (every sample `max_seq_len` long) or `zipf`: `P(min_seq_len + k) ∝ (k + 1)^-zipf_alpha`,
many short sequences and a heavy tail of long ones, as in production logs. With attention cost
quadratic in length, Zipf lengths make ranks' batches very unequal in work: what the balanced
batch shuffler evens out.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Sequence
from functools import partial
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field, StrictInt, StrictStr, ValidationInfo, field_validator
from torch.utils.data import Dataset

from recsys_pipe.config import Section, builder_field
from recsys_pipe.data.batch import ACTION_KEY, ITEM_KEY, USER_KEY, DataSpec, Sample, collate
from recsys_pipe.data.ids import SequenceIds, spread_ids
from recsys_pipe.data.serving import ACTION_IDS, SEQUENCE_COLUMNS, id_record, sequence_features
from recsys_pipe.data.source import SequenceDataConfig

__all__ = ["SyntheticConfig", "SyntheticDataConfig", "SyntheticSequenceDataset", "synthetic_dataset"]


class SyntheticConfig(Section):
    """Parameters of the synthetic world (`data.synthetic.*`; sequence shape is in `data.*`)."""

    num_items: StrictInt = Field(1000, ge=2, description="item vocabulary")
    num_users: StrictInt = Field(1000, ge=1, description="user vocabulary")
    num_clusters: StrictInt = Field(8, ge=1, description="user/item clusters with their own transition chains")
    num_tasks: StrictInt = Field(2, ge=1, le=8, description="binary engagement tasks (labels per candidate)")
    num_samples: StrictInt = Field(1_000_000, ge=1, description="samples over all ranks")
    min_seq_len: StrictInt = Field(8, ge=2, description="shortest sequence (raised to num_candidates + 1)")
    length_distribution: Literal["uniform", "fixed", "zipf"] = Field(
        "uniform",
        description="sequence lengths: uniform in [min_seq_len, data.max_seq_len], fixed (all data.max_seq_len) or "
        "zipf (P(min_seq_len + k) ∝ (k+1)^-zipf_alpha: mostly short, a heavy tail of long ones)",
    )
    zipf_alpha: float = Field(1.2, gt=0, description="exponent of the zipf length distribution")
    chain_prob: float = Field(0.8, ge=0, le=1, description="probability that the next item follows the chain")
    affinity_scale: float = Field(2.5, ge=0, description="weight of the cluster affinity in the label logits")
    quality_scale: float = Field(1.0, ge=0, description="weight of the per-item quality in the label logits")

    @field_validator("num_clusters")
    @classmethod
    def _clusters_have_items(cls, num_clusters: int, info: ValidationInfo) -> int:
        num_items = info.data.get("num_items")
        if isinstance(num_items, int) and num_clusters > num_items:
            raise ValueError(f"num_clusters ({num_clusters}) must be <= num_items ({num_items})")
        return num_clusters


class SyntheticDataConfig(SequenceIds, SequenceDataConfig):
    """`data=synthetic`: learnable user histories generated on the fly (no download)."""

    SIZE_KEY: ClassVar[str] = "data.synthetic.num_samples"

    name: Literal["synthetic"] = "synthetic"
    builder: StrictStr | None = builder_field("recsys_pipe.data.in_memory.synthetic:synthetic_dataset")
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig, description="the generated world")

    def spec(self) -> DataSpec:
        return _spec(self.synthetic, self.use_user_feature, self)


def _spec(cfg: SyntheticConfig, use_user_feature: bool, ids: SequenceIds) -> DataSpec:
    """Items, actions (the masked action 0, then one per combination of task outcomes) and users;
    with `data.ids=managed`, items and users get managed tables of as many rows."""
    vocab = {ITEM_KEY: ids.table_rows(cfg.num_items, "item"), ACTION_KEY: 2**cfg.num_tasks + 1}
    rows = {ITEM_KEY: "data.item_rows" if ids.item_rows else "data.synthetic.num_items"}
    if use_user_feature:
        vocab[USER_KEY] = ids.table_rows(cfg.num_users, "user")
        rows[USER_KEY] = "data.user_rows" if ids.user_rows else "data.synthetic.num_users"
    return DataSpec(num_tasks=cfg.num_tasks, vocab_sizes=vocab, managed=ids.managed_features(rows))


def synthetic_dataset(cfg: SyntheticDataConfig, rank: int, world_size: int) -> SyntheticSequenceDataset:
    """Builder of `data=synthetic`: this rank's share of the generated samples."""
    return SyntheticSequenceDataset(
        cfg.synthetic,
        cfg.seed,
        cfg.max_seq_len,
        cfg.num_candidates,
        rank,
        world_size,
        use_user_feature=cfg.use_user_feature,
        ids=cfg,
    )


class _World:
    """The seed-determined ground truth, kept as Python lists for fast per-sample sampling."""

    def __init__(self, cfg: SyntheticConfig, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.user_cluster: list[int] = torch.randint(cfg.num_clusters, (cfg.num_users,), generator=g).tolist()
        item_cluster = torch.randperm(cfg.num_items, generator=g) % cfg.num_clusters
        self.home_items: list[list[int]] = [
            torch.nonzero(item_cluster == c).flatten().tolist() for c in range(cfg.num_clusters)
        ]
        self.successor: list[list[int]] = [
            torch.randperm(cfg.num_items, generator=g).tolist() for _ in range(cfg.num_clusters)
        ]
        affinity = torch.randn(cfg.num_clusters, cfg.num_clusters, cfg.num_tasks, generator=g)
        quality = torch.randn(cfg.num_items, cfg.num_tasks, generator=g)
        logits = cfg.affinity_scale * affinity[:, item_cluster] + cfg.quality_scale * quality[None]
        self.prob: list[list[list[float]]] = torch.sigmoid(logits).tolist()


class SyntheticSequenceDataset(Dataset[Sample]):
    """This rank's share of the synthetic samples (map-style: index -> `Sample`).

    Args:
        cfg: world parameters.
        seed: world and sample seed.
        max_seq_len: max item tokens per sample (history + candidates).
        num_candidates: trailing tokens of each sample that are ranking candidates.
        rank, world_size: which disjoint share of the global samples this dataset serves.
        use_user_feature: whether batches carry the user id (the spec then sizes a user table).
        ids: how items and users are sent (`data.ids`): as generated (dense), or with `managed`
            as raw ids spread over the raw id space (`recsys_pipe.data.ids.spread_ids`).
    """

    def __init__(
        self,
        cfg: SyntheticConfig,
        seed: int,
        max_seq_len: int,
        num_candidates: int,
        rank: int = 0,
        world_size: int = 1,
        use_user_feature: bool = False,
        ids: SequenceIds | None = None,
    ) -> None:
        if not 0 < num_candidates < max_seq_len:
            raise ValueError(f"need 0 < num_candidates ({num_candidates}) < max_seq_len ({max_seq_len})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.cfg = cfg
        self.seed = seed
        self.max_seq_len = max_seq_len
        self.num_candidates = num_candidates
        self.min_seq_len = min(max(cfg.min_seq_len, num_candidates + 1), max_seq_len)
        self.rank = rank
        self.world_size = world_size
        self._world = _World(cfg, seed)
        self._length_cdf = _zipf_cdf(self.max_seq_len - self.min_seq_len + 1, cfg.zipf_alpha)
        self.ids = ids or SequenceIds()
        self.spec = _spec(cfg, use_user_feature, self.ids)
        self.collate = partial(collate, use_user_feature=use_user_feature)

    def __len__(self) -> int:
        return self.cfg.num_samples // self.world_size

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self):
            raise IndexError(index)
        global_index = index * self.world_size + self.rank
        return self._generate(global_index)

    def serving_features(self) -> dict[str, Any]:
        """Generated ids, taken as they are, or with `data.ids=managed` remapped by the program
        (`recsys_pipe.data.serving`)."""
        users = self._id_record(USER_KEY) if self.spec.vocab_sizes.get(USER_KEY) else None
        return sequence_features(
            self._id_record(ITEM_KEY), ACTION_IDS, True, self.max_seq_len, self.num_candidates, users
        )

    def _id_record(self, feature: str) -> dict[str, Any]:
        rows = self.spec.vocab_sizes[feature]
        if self.ids.ids == "managed":
            return id_record("managed", rows, input_hash_size=self.ids.managed.input_hash_size)
        return id_record("as_is", rows)

    def raw_rows(self, sample_ids: Sequence[int], split: str | None) -> list[dict[str, Any]]:
        """The generated samples `sample_ids` as rows: every event's action, the candidates' too."""
        rows = []
        for index in map(int, sample_ids):
            s = self._generate(index)
            actions = s.history_actions + [1 + sum(int(b) << k for k, b in enumerate(bits)) for bits in s.labels]
            rows.append(
                {
                    SEQUENCE_COLUMNS["user"]: s.user,
                    SEQUENCE_COLUMNS["items"]: s.items,
                    SEQUENCE_COLUMNS["timestamps"]: s.timestamps,
                    SEQUENCE_COLUMNS["actions"]: actions,
                }
            )
        return rows

    def _length(self, rng: random.Random) -> int:
        distribution = self.cfg.length_distribution
        if distribution == "uniform":
            return rng.randint(self.min_seq_len, self.max_seq_len)
        if distribution == "fixed":
            return self.max_seq_len
        k = bisect.bisect_left(self._length_cdf, rng.random())
        return self.min_seq_len + min(k, len(self._length_cdf) - 1)

    def _generate(self, global_index: int) -> Sample:
        cfg, world = self.cfg, self._world
        rng = random.Random(self.seed * 1_000_003 + global_index)
        length = self._length(rng)
        user = rng.randrange(cfg.num_users)
        cluster = world.user_cluster[user]
        home = world.home_items[cluster]
        chain = world.successor[cluster]
        item = rng.choice(home)
        t = rng.randrange(1_000_000_000, 1_500_000_000)
        items, timestamps, actions, labels = [], [], [], []
        for _ in range(length):
            bits = [float(rng.random() < p) for p in world.prob[cluster][item]]
            items.append(item)
            timestamps.append(t)
            actions.append(1 + sum(int(b) << k for k, b in enumerate(bits)))
            labels.append(bits)
            item = chain[item] if rng.random() < cfg.chain_prob else rng.choice(home)
            t += 1 + int(rng.expovariate(1.0) * math.e ** rng.uniform(2.0, 12.0))
        n_hist = length - self.num_candidates
        if self.ids.ids == "managed":
            size = self.ids.managed.input_hash_size
            items, user = spread_ids(np.array(items), 0, size).tolist(), int(spread_ids(np.array([user]), 1, size)[0])
        return Sample(
            sample_id=global_index,
            user=user,
            items=items,
            timestamps=timestamps,
            history_actions=actions[:n_hist],
            labels=labels[n_hist:],
        )


def _zipf_cdf(n: int, alpha: float) -> list[float]:
    """Cumulative probabilities of a Zipf law over `n` values: `P(k) ∝ (k + 1)^-alpha`."""
    weights = [(k + 1) ** -alpha for k in range(n)]
    total = sum(weights)
    return [c / total for c in itertools.accumulate(weights)]
