"""Sequential-recommendation data: synthetic (default) and MovieLens, as torchrec-pipelineable batches."""

from recsys_pipe.data.batch import ACTION_KEY, ITEM_KEY, MASKED_ACTION, USER_KEY, Batch, Sample, collate
from recsys_pipe.data.loader import DataConfig, make_dataloader, make_dataset
from recsys_pipe.data.movielens import MovieLensDataset, read_ratings
from recsys_pipe.data.spec import DataSpec
from recsys_pipe.data.synthetic import SyntheticConfig, SyntheticSequenceDataset

__all__ = [
    "ACTION_KEY",
    "ITEM_KEY",
    "MASKED_ACTION",
    "USER_KEY",
    "Batch",
    "DataConfig",
    "DataSpec",
    "MovieLensDataset",
    "Sample",
    "SyntheticConfig",
    "SyntheticSequenceDataset",
    "collate",
    "make_dataloader",
    "make_dataset",
    "read_ratings",
]
