"""The per-rank DataLoader of batches, and `DataConfig`, the base of every data source's config.

A data source is a builder and its config class (see `recsys_pipe.config.registry`):

    def build(cfg: MyDataConfig, rank: int, world_size: int) -> Dataset

The dataset is map-style (`len`, `[i]` -> sample) and holds this rank's disjoint share of the
data; it has `spec` (a `DataSpec`, which sizes the model) and `collate(samples) -> batch` (a
batch following the protocol in `recsys_pipe.data.batch`). Shipped sources are registered by
name in `recsys_pipe.data.registry`; this module turns any of them into batches the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from pydantic import Field, StrictBool, StrictInt, ValidationInfo, field_validator
from torch.utils.data import DataLoader, Dataset, RandomSampler

from recsys_pipe.config import Component
from recsys_pipe.data.spec import DataSpec

__all__ = ["DataConfig", "SequenceDataConfig", "make_dataloader"]


class DataConfig(Component):
    """Batch shape and loading, shared by every data source (`data.*`). A builder whose config
    parameter is not annotated gets this class."""

    batch_size: StrictInt = Field(32, ge=1, description="samples per batch per rank")
    num_batches: StrictInt | None = Field(
        None, ge=1, description="training batches per rank (null: the whole share of the data)"
    )
    seed: StrictInt = Field(0, description="data seed (synthetic world, shuffling)")
    shuffle: StrictBool = Field(False, description="shuffle the training samples (seeded by data.seed)")
    num_workers: StrictInt = Field(0, ge=0, description="DataLoader worker processes")
    pin_memory: StrictBool = Field(False, description="pin host batches (CUDA: asynchronous host-to-device copies)")

    def dataset(self, rank: int, world_size: int) -> Dataset:
        """This rank's disjoint share of the source (the builder's result): `.spec` sizes the
        model, `.collate` turns a list of samples into a batch."""
        return self.builder_fn()(self, rank, world_size)

    def spec(self) -> DataSpec:
        """The model-sizing spec of this source. Sources that know it from their config alone
        override this; by default it is read from a one-rank dataset."""
        return self.dataset(0, 1).spec


class SequenceDataConfig(DataConfig):
    """Sources of user interaction sequences (`Sample` -> `Batch`)."""

    max_seq_len: StrictInt = Field(32, ge=2, description="max item tokens per sample (history + candidates)")
    num_candidates: StrictInt = Field(4, ge=1, description="trailing tokens of each sample that are ranked")
    use_user_feature: StrictBool = Field(False, description="add the user id as a contextual token")

    @field_validator("num_candidates")
    @classmethod
    def _candidates_fit(cls, num_candidates: int, info: ValidationInfo) -> int:
        max_seq_len = info.data.get("max_seq_len")
        if isinstance(max_seq_len, int) and num_candidates >= max_seq_len:
            raise ValueError(
                f"num_candidates ({num_candidates}) must be < max_seq_len ({max_seq_len}): "
                "a sample needs at least one history token"
            )
        return num_candidates


def make_dataloader(
    cfg: DataConfig, rank: int = 0, world_size: int = 1, split: str = "train", num_batches: int | None = None
) -> DataLoader:
    """DataLoader of batches for one rank (`loader.dataset.spec` sizes the model).

    `split="train"` reads this rank's share from its start (`cfg.num_batches` batches, or all);
    `split="eval"` reads `num_batches` held-out batches from the end of the share, so evaluation
    never sees a training sample. Shuffling, if on, is seeded by `cfg.seed`: the batch order is
    reproducible too. Batches are `drop_last` so every rank trains the same number of equally
    sized batches (a rank with one batch more would hang the collectives).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    dataset = cfg.dataset(rank, world_size)
    batches = cfg.num_batches if split == "train" else num_batches
    if split == "eval" and batches is None:
        raise ValueError("split='eval' needs num_batches")
    num_samples = len(dataset) if batches is None else batches * cfg.batch_size
    if num_samples > len(dataset):
        raise ValueError(
            f"{batches} batches x batch_size={cfg.batch_size} exceeds the {len(dataset)} samples of "
            f"rank {rank}/{world_size}"
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
        collate_fn=dataset.collate,
    )
