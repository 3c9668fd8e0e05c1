"""Sequential-recommendation data: synthetic (default) and MovieLens, as torchrec-pipelineable batches.

Each source is a `DataConfig` subclass next to its dataset, registered by name in
`DATA_SOURCES`; `make_dataloader(cfg, rank, world_size)` turns any of them into batches.
"""

from recsys_pipe.data.batch import ACTION_KEY, ITEM_KEY, MASKED_ACTION, USER_KEY, Batch, Sample, collate
from recsys_pipe.data.loader import DataConfig, EpochSampler, RankData, SequenceDataConfig, make_dataloader
from recsys_pipe.data.movielens import MovieLensDataConfig, MovieLensDataset, read_ratings
from recsys_pipe.data.registry import DATA_SOURCES
from recsys_pipe.data.spec import DataSpec
from recsys_pipe.data.synthetic import SyntheticConfig, SyntheticDataConfig, SyntheticSequenceDataset

__all__ = [
    "ACTION_KEY",
    "DATA_SOURCES",
    "ITEM_KEY",
    "MASKED_ACTION",
    "USER_KEY",
    "Batch",
    "DataConfig",
    "DataSpec",
    "EpochSampler",
    "MovieLensDataConfig",
    "MovieLensDataset",
    "RankData",
    "Sample",
    "SequenceDataConfig",
    "SyntheticConfig",
    "SyntheticDataConfig",
    "SyntheticSequenceDataset",
    "collate",
    "make_dataloader",
    "read_ratings",
]
