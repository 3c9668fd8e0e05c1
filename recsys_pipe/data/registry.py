"""Data sources by name (`data.name=...`): each entry is the import path of the source's config."""

from recsys_pipe.config import Registry

__all__ = ["DATA_SOURCES"]

DATA_SOURCES = Registry(
    "data source",
    {
        "synthetic": "recsys_pipe.data.synthetic:SyntheticDataConfig",
        "movielens": "recsys_pipe.data.movielens:MovieLensDataConfig",
    },
)
