"""The source contract: `DataConfig`, the base of every data source's config, and the bases of
the kinds of source a model trains on (`SequenceDataConfig`: HSTU ranking samples;
`SequenceSourceConfig`: next-item retrieval users; `TabularDataConfig`: the DLRM family's rows),
and the per-rank DataLoader of batches (`RankData`, `make_dataloader`).

A data source is a builder and its config class (see `recsys_pipe.config.registry`):

    def build(cfg: MyDataConfig, rank: int, world_size: int) -> Dataset

The dataset is map-style (`len`, `[i]` -> sample) and holds this rank's disjoint share of the
data; it has `spec` (a `DataSpec`, which sizes the model) and `collate(samples) -> batch` (a
batch following the protocol in `recsys_pipe.data.batch`). Shipped sources are registered by
name in `recsys_pipe.data.registry`; this module turns any of them into batches the same way.

Training reads its batches by *position*: batch `p` of a run is batch `p % P` of epoch `p // P`
(P batches per epoch), and epoch `e`'s sample order is fixed by `(data.seed + e)`. So the number
of batches trained is the whole data state of a run: a checkpoint stores it, and a resumed run
builds its loader from that position (`RankData.train_loader(start=p)`).

Why not torchdata's `StatefulDataLoader`: its state is the position of the next batch it
*yields*. A plan with lookaheads pulls batches ahead of the one it trains (up to its maximum lookahead,
plus the loader's own prefetch), so that state would have to be snapshotted per pulled batch and
carried through the ring to know what was trained. Our datasets are map-style and deterministic
per index, so the position of the next batch to train is enough and exact.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, PrivateAttr, StrictBool, StrictInt, ValidationInfo, field_validator
from torch.utils.data import DataLoader, Dataset, Sampler

from recsys_pipe.config import Component, ConfigError, ConfigProblem, home_expanded
from recsys_pipe.data.batch import DataSpec

log = logging.getLogger(__name__)

__all__ = [
    "SPLITS",
    "DataConfig",
    "EpochSampler",
    "PositionalSource",
    "RankData",
    "SequenceDataConfig",
    "SequenceSourceConfig",
    "TabularDataConfig",
    "has_eval_splits",
    "make_dataloader",
    "readable_file",
]


def readable_file(path: str) -> str:
    """`path` (`~` expanded) if it is a readable file, else ValueError (for a `data.path` field validator)."""
    path = home_expanded(path)
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory; data.path names a file")
    if not os.path.isfile(path):
        raise ValueError(f"no such file: {path}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"file is not readable: {path}")
    return path


class DataConfig(Component):
    """Batch shape and loading, shared by every data source (`data.*`). A builder whose config
    parameter is not annotated gets this class."""

    #: the config key that decides how many samples the source has (named by "too small" errors)
    SIZE_KEY: ClassVar[str] = "data"

    batch_size: StrictInt = Field(32, ge=1, description="samples per batch per rank")
    num_batches: StrictInt | None = Field(
        None, ge=1, description="training batches per rank per epoch (null: the whole share minus held-out batches)"
    )
    seed: StrictInt = Field(0, description="data seed (synthetic world; epoch e is shuffled with seed + e)")
    shuffle: StrictBool = Field(False, description="shuffle the training samples every epoch (seeded by data.seed)")
    num_workers: StrictInt = Field(0, ge=0, description="DataLoader worker processes")
    pin_memory: StrictBool = Field(False, description="pin host batches (CUDA: asynchronous host-to-device copies)")
    on_bad_row: Literal["fail", "skip"] = Field(
        "fail",
        description="a row the source refuses while training (Parquet sources): fail (stop the run naming file, row "
        "and column) or skip (leave it out of its batch, counted in the log, metrics.jsonl and status.json)",
    )

    def dataset(self, rank: int, world_size: int) -> Dataset:
        """This rank's disjoint share of the source (the builder's result): `.spec` sizes the
        model, `.collate` turns a list of samples into a batch."""
        return self.call_builder("data", rank, world_size)

    def spec(self) -> DataSpec:
        """The model-sizing spec of this source. Sources that know it from their config alone
        override this; by default it is read from a one-rank dataset."""
        return self.dataset(0, 1).spec

    def as_kind(self, kind: type[DataConfig]) -> DataConfig:
        """This source's config for a model that trains on `kind` sources (its
        `ModelConfig.data_kind`, a base class of data configs): by default this config as it is,
        which the model's `check_data` accepts or refuses. A source that serves several kinds of
        model (`data=parquet_sequences`: next-item retrieval and HSTU ranking) returns its config
        of that kind, so the model's checks and the builder see the source it needs. ConfigError
        for values that do not fit that kind."""
        return self


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


class TabularDataConfig(DataConfig):
    """Base of the sources of tabular rows that the DLRM models train on.

    A subclass's builder returns batches with `dense_features [B, num_dense]` float32,
    `sparse_features` (a KJT with one key per feature of `spec().vocab_sizes`), `labels
    [B, num_tasks]` float32 and `sample_ids [B]`; `spec()` (by default read from a one-rank
    dataset) sizes the model. `multi_hot_features()` names the features with more than one id
    per row (only torchrec's pooled tables take them).
    """

    def multi_hot_features(self) -> list[str]:
        """The sparse features that hold a list of ids per row (none by default)."""
        return []


class SequenceSourceConfig(DataConfig):
    """The keys of every next-item retrieval source (`data=sequences`, `data=parquet_sequences`):
    batches of users, the sample length, the shuffle and the evaluation protocol."""

    batch_size: StrictInt = Field(128, ge=1, description="samples (users) per batch per rank")
    eval_batch_size: StrictInt | None = Field(
        None,
        ge=1,
        description="users per evaluation batch per rank (null: batch_size); larger batches fetch the catalogue for "
        "full-corpus ranking less often",
    )
    max_seq_len: StrictInt = Field(50, ge=1, description="most recent interactions a sample feeds the model")
    shuffle: StrictBool = Field(True, description="shuffle the training users every epoch (seeded by data.seed)")
    eval_negatives: StrictInt = Field(
        100, ge=1, description="sampled protocol: items the user never interacted with, ranked with the held-out one"
    )
    full_eval: StrictBool = Field(
        True, description="also rank the held-out item against the whole catalogue (full-corpus protocol)"
    )
    #: training negatives drawn per target: derived from the model (`ModelConfig.data_for_model`),
    #: never a key of its own, so the count is set once (`model.num_negatives`)
    _negatives_per_target: int = PrivateAttr(1)

    @property
    def negatives_per_target(self) -> int:
        """Training negatives drawn per target (1 unless the model asked for more)."""
        return self._negatives_per_target

    def with_negatives_per_target(self, count: int) -> SequenceSourceConfig:
        """A copy of this config whose source draws `count` training negatives per target."""
        if count < 1:
            raise ValueError(f"negatives per target must be >= 1, got {count}")
        copy = self.model_copy()
        copy._negatives_per_target = count
        return copy


class PositionalSource(ABC):
    """A source that plans its own batches by position (the Parquet sources'
    `recsys_pipe.data.parquet.stream.StreamSource`): a builder may return one instead of a map-style
    dataset, and `RankData` delegates to it. Its data state is still the number of batches
    trained, and it maps a checkpoint's position onto its own layout (`resume_layout`)."""

    spec: DataSpec
    #: training batches per rank per epoch and held-out batches per rank (after `prepare`)
    batches_per_epoch: int
    eval_batches: int

    @abstractmethod
    def prepare(self, eval_batches: int) -> None:
        """Split the data into training and `eval_batches` held-out batches per rank."""

    @abstractmethod
    def train_loader(self, epochs: int = 1, start: int = 0) -> Iterable[Any]:
        """The batches of `epochs` epochs from batch position `start`."""

    @abstractmethod
    def eval_loader(self) -> Iterable[Any] | None:
        """The held-out batches, or None."""

    @abstractmethod
    def resume_layout(self, position: int, layouts: Sequence[tuple[int, ...]]) -> int:
        """Continue from `position` of a run whose current epoch was trained under `layouts`
        (`(world, batch, since)` each, as `layout_state` gives them); the position to start from."""

    @abstractmethod
    def layout_state(self, position: int) -> list[list[int]]:
        """The layouts of the epoch at `position`, `[[world, batch, since], ...]`."""


class EpochSampler(Sampler[int]):
    """Sample indices of `epochs` passes over `range(num_samples)`, starting at batch `start`.

    Each epoch uses the first `batches_per_epoch * batch_size` indices of its order: identity, or
    with `shuffle` a permutation of all `num_samples` drawn from a generator seeded `seed + epoch`
    (a different subset is left over each epoch). Batches therefore never straddle epochs, and
    one DataLoader (with its workers) serves every epoch without a pause at the boundaries.
    With `epoch_stride`, epoch `e`'s indices are offset by `e * epoch_stride`: a dataset that
    draws something afresh every epoch (negatives) reads the epoch from the index.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        batches_per_epoch: int,
        epochs: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        start: int = 0,
        epoch_stride: int = 0,
    ) -> None:
        if batches_per_epoch * batch_size > num_samples:
            raise ValueError(f"{batches_per_epoch} batches of {batch_size} exceed {num_samples} samples")
        if not 0 <= start <= epochs * batches_per_epoch:
            raise ValueError(f"start batch {start} outside [0, {epochs * batches_per_epoch}]")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.batches_per_epoch = batches_per_epoch
        self.epochs = epochs
        self.shuffle = shuffle
        self.seed = seed
        self.start = start
        self.epoch_stride = epoch_stride

    def epoch_order(self, epoch: int) -> list[int]:
        """The indices epoch `epoch` trains, in order."""
        used = self.batches_per_epoch * self.batch_size
        offset = epoch * self.epoch_stride
        if not self.shuffle:
            return list(range(offset, offset + used))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return (torch.randperm(self.num_samples, generator=generator)[:used] + offset).tolist()

    def __iter__(self) -> Iterator[int]:
        if self.batches_per_epoch == 0:
            return
        first_epoch, first_batch = divmod(self.start, self.batches_per_epoch)
        for epoch in range(first_epoch, self.epochs):
            skip = first_batch * self.batch_size if epoch == first_epoch else 0
            yield from self.epoch_order(epoch)[skip:]

    def __len__(self) -> int:
        return (self.epochs * self.batches_per_epoch - self.start) * self.batch_size


#: the evaluation splits of a dataset that brings its own (`has_eval_splits`): next-item retrieval's
#: leave-one-out validation and test items
SPLITS = ("valid", "test")


def has_eval_splits(dataset: Dataset) -> bool:
    """Whether `dataset` brings its own evaluation splits (`dataset.split(name, batch_size)`)
    instead of holding out the tail of the training share."""
    return callable(getattr(dataset, "split", None))


class RankData:
    """This rank's share of a data source, split once into training and held-out batches.

    The last `eval_batches` batches of the share are held out for evaluation (none for a dataset
    with its own evaluation splits, `split(name, batch_size)`, such as `data=sequences`); training reads
    `data.num_batches` batches per epoch from the start of the share (default: all that is not
    held out). Sizes that do not fit are a `ConfigError` naming the keys to change.
    """

    def __init__(self, cfg: DataConfig, rank: int = 0, world_size: int = 1, eval_batches: int = 0) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.dataset = cfg.dataset(rank, world_size)
        #: a source that plans its own batches (the Parquet sources)
        self.stream = self.dataset if isinstance(self.dataset, PositionalSource) else None
        if self.stream is None and cfg.on_bad_row == "skip":
            raise ConfigError(
                ConfigProblem(
                    "data.on_bad_row",
                    f"skip is for the Parquet sources (data=parquet, parquet_sequences), which read rows while "
                    f"training; data={cfg.label} reads every row before the first step and refuses a bad one there",
                )
            )
        if self.stream is not None:
            self.stream.prepare(eval_batches)
            self.eval_batches = self.stream.eval_batches
            self.batches_per_epoch = self.stream.batches_per_epoch
            return
        self.eval_batches = eval_batches = 0 if has_eval_splits(self.dataset) else eval_batches
        size = len(self.dataset)
        batch = cfg.batch_size
        held_out = eval_batches * batch
        if cfg.num_batches is not None:
            if (cfg.num_batches * batch) + held_out > size:
                raise ConfigError(
                    ConfigProblem(
                        "data.num_batches",
                        f"{cfg.num_batches} batches x data.batch_size={batch} plus trainer.eval_batches={eval_batches} "
                        f"held-out batches need {cfg.num_batches * batch + held_out} samples, but rank {rank} of "
                        f"{world_size} has {size}",
                    )
                )
            self.batches_per_epoch = cfg.num_batches
        else:
            self.batches_per_epoch = (size - held_out) // batch if size > held_out else 0
        if self.batches_per_epoch < 1:
            raise ConfigError(
                ConfigProblem(
                    cfg.SIZE_KEY,
                    f"too little data: rank {rank} of {world_size} gets {size} samples, fewer than one training "
                    f"batch (data.batch_size={batch}) plus trainer.eval_batches={eval_batches} held-out batches "
                    f"({batch + held_out} samples); lower data.batch_size or trainer.eval_batches, or use fewer ranks",
                )
            )

    @property
    def spec(self) -> Any:
        """The dataset's `DataSpec` (vocabulary sizes for the model)."""
        return self.dataset.spec

    def layout_state(self, position: int) -> str:
        """The data-parallel layouts the epoch at `position` was trained under, for a checkpoint:
        `"W x B @ since"` entries joined by `,` (a streaming source continues an epoch across a
        change of world size from them, `resume_position`)."""
        if self.stream is not None:
            layouts = self.stream.layout_state(position)
        else:
            layouts = [(self.world_size, self.cfg.batch_size, 0)]
        return ",".join(f"{w}x{b}@{since}" for w, b, since in layouts)

    def resume_position(
        self, position: int, world_size: int, batch_size: int, batches_per_epoch: int, layouts: str | None = None
    ) -> int:
        """Where a run resumed from a checkpoint at `position` starts, in this run's batches.

        The checkpoint's run had `world_size` ranks of `batch_size` and `batches_per_epoch`
        (`layouts`: its `layout_state`). The same layout: `position`. A streaming source with the
        same global batch size continues the epoch exactly: every row of it trained once over
        the two runs (a different global batch size is a ConfigError). A map-style source
        continues the same epoch at the same fraction of it: its ranks' shares differ, so the
        rest of the epoch is not exactly the samples the old run had left (a warning says so).
        """
        if self.stream is not None:
            if layouts:  # "WxB@since,..."
                parsed = [tuple(int(x) for x in part.replace("@", "x").split("x")) for part in layouts.split(",")]
            else:
                parsed = [(world_size, batch_size, 0)]
            start = self.stream.resume_layout(position, parsed)
            if self.rank == 0 and (world_size, batch_size) != (self.world_size, self.cfg.batch_size):
                log.warning(
                    "resuming a checkpoint of %d rank(s) x data.batch_size=%d on %d rank(s) x %d: the same global "
                    "batch; epoch %d continues at batch %d with the rows the old ranks had not trained",
                    world_size,
                    batch_size,
                    self.world_size,
                    self.cfg.batch_size,
                    start // self.batches_per_epoch + 1,
                    start % self.batches_per_epoch,
                )
            return start
        new = (self.world_size, self.cfg.batch_size, self.batches_per_epoch)
        if (world_size, batch_size, batches_per_epoch) == new:
            return position
        epoch, done = divmod(position, batches_per_epoch)
        batch = done * self.batches_per_epoch // batches_per_epoch
        if self.rank == 0:
            log.warning(
                "resuming a checkpoint of %d rank(s) x %d batches/epoch on %d rank(s) x %d batches/epoch: the data "
                "split differs, so epoch %d continues at the same share of it (batch %d of %d, where the checkpoint "
                "was at %d of %d), not bitwise as the original run would have (for an exact continuation use "
                "data=parquet or data=parquet_sequences)",
                world_size,
                batches_per_epoch,
                self.world_size,
                self.batches_per_epoch,
                epoch + 1,
                batch,
                self.batches_per_epoch,
                done,
                batches_per_epoch,
            )
        return epoch * self.batches_per_epoch + batch

    def train_sampler(self, epochs: int = 1, start: int = 0) -> EpochSampler:
        """The sampler of this rank's training batches (the held-out ones left out).

        Args:
            epochs: how many epochs it yields.
            start: the position (batch number over all epochs) to start from, e.g. on resume.

        Returns:
            An `EpochSampler` over the training part of the share: each epoch's order depends only on
            `data.seed` and the epoch."""
        cfg = self.cfg
        return EpochSampler(
            len(self.dataset) - self.eval_batches * cfg.batch_size,
            cfg.batch_size,
            self.batches_per_epoch,
            epochs=epochs,
            shuffle=cfg.shuffle,
            seed=cfg.seed,
            start=start,
            epoch_stride=len(self.dataset) if getattr(self.dataset, "resamples_per_epoch", False) else 0,
        )

    def train_loader(self, epochs: int = 1, start: int = 0) -> Iterable[Any]:
        """Training batches of `epochs` epochs from batch position `start` (across epochs)."""
        if self.stream is not None:
            return self.stream.train_loader(epochs, start)
        return self._loader(self.train_sampler(epochs, start))

    def eval_loader(self) -> Iterable[Any] | None:
        """The held-out batches (the tail of the share), or None without `eval_batches`."""
        if self.stream is not None:
            return self.stream.eval_loader()
        if not self.eval_batches:
            return None
        size = len(self.dataset)
        return self._loader(range(size - self.eval_batches * self.cfg.batch_size, size))

    def _loader(self, sampler: Any) -> DataLoader:
        cfg = self.cfg
        return DataLoader(
            self.dataset,
            batch_size=cfg.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=cfg.num_workers,
            pin_memory=cfg.pin_memory,
            collate_fn=self.dataset.collate,
            # its own generator: creating an iterator must not draw from the global torch RNG,
            # whose state a checkpoint restores (and dropout consumes)
            generator=torch.Generator().manual_seed(cfg.seed),
        )


def make_dataloader(
    cfg: DataConfig, rank: int = 0, world_size: int = 1, split: str = "train", num_batches: int | None = None
) -> DataLoader:
    """DataLoader of batches for one rank (`loader.dataset.spec` sizes the model).

    Batches are `drop_last` so every rank trains the same number of equally sized batches (a rank
    with one batch more would hang the collectives). The trainer uses `RankData`, which also keeps
    the held-out tail out of training and resumes at a batch position.

    Args:
        cfg: the data section.
        rank: this rank; it reads its own share of the data.
        world_size: the number of ranks sharing the data.
        split: `train` reads one epoch of the share from its start (`cfg.num_batches` batches, or
            all); `eval` reads `num_batches` held-out batches from the end of the share.
        num_batches: how many batches `split="eval"` reads.

    Returns:
        A torch `DataLoader` whose dataset has `spec`."""
    if split == "train":
        return RankData(cfg, rank, world_size).train_loader()
    if split == "eval":
        if num_batches is None:
            raise ValueError("split='eval' needs num_batches")
        loader = RankData(cfg, rank, world_size, eval_batches=num_batches).eval_loader()
        assert loader is not None
        return loader
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
