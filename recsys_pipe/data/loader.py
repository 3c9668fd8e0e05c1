"""Build the per-rank DataLoader of `Batch` from a plain config."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, RandomSampler

from recsys_pipe.data.batch import collate
from recsys_pipe.data.movielens import MovieLensDataset
from recsys_pipe.data.synthetic import SyntheticConfig, SyntheticSequenceDataset

SequenceDataset = SyntheticSequenceDataset | MovieLensDataset


@dataclass(frozen=True)
class DataConfig:
    """Data source and batch shape (field names mirror the YAML `data` group).

    `name` is `"synthetic"` (the embedded default) or `"movielens"` (needs `path`).
    `num_batches` caps the batches per rank (`None`: the whole per-rank share).
    `max_seq_len` counts item tokens (history + candidates) per sample; the optional `user`
    contextual token is extra. Batches are `drop_last` so every rank trains the same number
    of equally sized batches (a rank with one batch more would hang the collectives).
    """

    name: str = "synthetic"
    path: str | None = None
    batch_size: int = 32
    num_batches: int | None = None
    seed: int = 0
    max_seq_len: int = 32
    num_candidates: int = 4
    use_user_feature: bool = False
    shuffle: bool = False
    num_workers: int = 0
    pin_memory: bool = False
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


def make_dataset(cfg: DataConfig, rank: int = 0, world_size: int = 1) -> SequenceDataset:
    """This rank's disjoint share of the configured source; `.spec` sizes the model."""
    if cfg.name == "synthetic":
        return SyntheticSequenceDataset(cfg.synthetic, cfg.seed, cfg.max_seq_len, cfg.num_candidates, rank, world_size)
    if cfg.name == "movielens":
        if cfg.path is None:
            raise ValueError("data.name=movielens needs data.path (ratings.dat or ratings.csv)")
        return MovieLensDataset(cfg.path, cfg.max_seq_len, cfg.num_candidates, rank, world_size)
    raise ValueError(f"unknown data.name {cfg.name!r}; expected 'synthetic' or 'movielens'")


def make_dataloader(
    cfg: DataConfig, rank: int = 0, world_size: int = 1, split: str = "train", num_batches: int | None = None
) -> DataLoader:
    """DataLoader of `Batch` for one rank (`loader.dataset.spec` sizes the model).

    `split="train"` reads this rank's share from its start (`cfg.num_batches` batches, or
    all); `split="eval"` reads `num_batches` held-out batches from the end of the share, so
    evaluation never sees a training sample while the world (clusters, chains) is the same.
    Shuffling, if on, is seeded by `cfg.seed`: the batch order is reproducible too.
    """
    dataset = make_dataset(cfg, rank, world_size)
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    batches = cfg.num_batches if split == "train" else num_batches
    if split == "eval" and batches is None:
        raise ValueError("split='eval' needs num_batches")
    num_samples = len(dataset) if batches is None else batches * cfg.batch_size
    if num_samples > len(dataset):
        raise ValueError(
            f"{batches} batches x batch_size={cfg.batch_size} exceeds the "
            f"{len(dataset)} samples of rank {rank}/{world_size}"
        )
    if split == "eval":
        sampler: Iterable[int] = range(len(dataset) - num_samples, len(dataset))
    elif cfg.shuffle:
        generator = torch.Generator().manual_seed(cfg.seed)
        sampler = RandomSampler(dataset, num_samples=num_samples, generator=generator)
    else:
        sampler = range(num_samples)
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory,
        collate_fn=functools.partial(collate, use_user_feature=cfg.use_user_feature),
    )
