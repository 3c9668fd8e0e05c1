"""A model and a data source defined outside recsys_pipe, as a user writes them (the README's
example): picked with `model=custom model.builder=custom_components:build_model` and
`data=custom data.builder=custom_components:build_data` (this directory on PYTHONPATH)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn
from torch.utils.data import Dataset
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from recsys_pipe.data import DataConfig, DataSpec
from recsys_pipe.data.batch import CriteoBatch
from recsys_pipe.models import ShardedModelConfig


class PooledConfig(ShardedModelConfig):
    """model.* keys of the custom model (ShardedModelConfig: its torchrec tables get sharded)."""

    embedding_dim: int = Field(8, ge=1, description="table width")
    hidden: int = Field(16, ge=1, description="MLP width")


class Pooled(nn.Module):
    """Embeddings of every sparse feature, concatenated with the dense features, through an MLP."""

    def __init__(self, cfg: PooledConfig, spec: DataSpec) -> None:
        super().__init__()
        self.tables = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"{f}_table", embedding_dim=cfg.embedding_dim, num_embeddings=n, feature_names=[f]
                )
                for f, n in spec.vocab_sizes.items()
            ]
        )
        width = cfg.embedding_dim * len(spec.vocab_sizes) + spec.num_dense
        self.mlp = nn.Sequential(nn.Linear(width, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, spec.num_tasks))

    def forward(self, batch):
        pooled = self.tables(batch.sparse_features).values()  # torchrec finds batch.sparse_features
        logits = self.mlp(torch.cat([pooled, batch.dense_features], dim=1))
        per_row = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
        return per_row.mean(), {"logits": logits.detach(), "labels": batch.labels, "loss_sum": per_row.sum()}


def build_model(cfg: PooledConfig, spec: DataSpec) -> nn.Module:
    return Pooled(cfg, spec)


def build_vocab_dependent_model(cfg: PooledConfig, spec: DataSpec) -> nn.Module:
    """`Pooled` with a parameter outside its torchrec tables as long as the first vocabulary (a
    per-row bias): `model.table_init=per_shard` cannot build it."""
    model = Pooled(cfg, spec)
    model.row_bias = nn.Parameter(torch.zeros(next(iter(spec.vocab_sizes.values()))))
    return model


class ClicksConfig(DataConfig):
    """data.* keys of the custom source."""

    num_users: int = Field(50, ge=1, description="user ids")
    num_samples: int = Field(10_000, ge=1, description="rows over all ranks")


class Clicks(Dataset):
    """A click happens when the user id and item id have the same parity (learnable from ids)."""

    def __init__(self, cfg: ClicksConfig, rank: int, world_size: int) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.spec = DataSpec(num_tasks=1, vocab_sizes={"user": cfg.num_users, "item": 20}, num_dense=1)

    def __len__(self) -> int:
        return self.cfg.num_samples // self.world_size

    def __getitem__(self, index: int):
        sample_id = index * self.world_size + self.rank
        g = torch.Generator().manual_seed(self.cfg.seed * 100_003 + sample_id)
        user, item = (
            int(torch.randint(self.cfg.num_users, (1,), generator=g)),
            int(torch.randint(20, (1,), generator=g)),
        )
        return sample_id, user, item, float((user + item) % 2 == 0)

    def collate(self, samples) -> CriteoBatch:
        ids, users, items, labels = zip(*samples)
        return CriteoBatch(
            dense_features=torch.ones(len(ids), 1),
            sparse_ids=torch.tensor([users, items]).t().contiguous(),
            labels=torch.tensor(labels)[:, None],
            sample_ids=torch.tensor(ids),
            keys=("user", "item"),
        )


def build_data(cfg: ClicksConfig, rank: int, world_size: int) -> Dataset:
    return Clicks(cfg, rank, world_size)
