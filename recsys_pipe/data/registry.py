"""Data sources by name (`data.name=...`): each entry is the import path of the source's config
class, which names its builder; `data.builder=pkg.module:function` picks any other builder."""

from recsys_pipe.config import Registry
from recsys_pipe.data.source import DataConfig

__all__ = ["DATA_SOURCES"]

DATA_SOURCES = Registry(
    "data source",
    DataConfig,
    {
        "synthetic": "recsys_pipe.data.in_memory.synthetic:SyntheticDataConfig",
        "movielens": "recsys_pipe.data.in_memory.movielens:MovieLensDataConfig",
        "criteo": "recsys_pipe.data.in_memory.criteo:CriteoDataConfig",
        "criteo_synthetic": "recsys_pipe.data.in_memory.criteo:CriteoSyntheticDataConfig",
        "sequences": "recsys_pipe.data.in_memory.sequences:SequencesDataConfig",
        "parquet": "recsys_pipe.data.parquet.tabular:ParquetDataConfig",
        "parquet_sequences": "recsys_pipe.data.parquet.sequences:ParquetSequencesDataConfig",
    },
)
