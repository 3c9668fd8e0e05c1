"""Data sources and batches: synthetic sequences and MovieLens (for HSTU), Criteo files and a
generated Criteo-like source (for DLRM), and per-user item sequences for next-item retrieval
(`data=sequences`, for SASRec and HSTU retrieval), and Parquet files of any size streamed by
position (`data=parquet`: tabular rows; `data=parquet_sequences`: per-user sequences for
next-item retrieval, or windows of ratings for HSTU ranking, whichever the model trains on).

The sub-packages are its layers: the batch contract (`batch`: the batch protocol, the batch
types, their keys, `DataSpec`; models, pipeline stages and task functions import them from
there), the source contract (`source`: `DataConfig`, the bases of the kinds of source,
`RankData`), in-memory sources (`in_memory`), text parsers (`text`), streaming Parquet
(`parquet`), the negative sampler (`negatives`), raw ids mapped to rows (`ids`), what an
export ships to turn raw rows into a model's inputs (`preprocess`, numpy and torch only, and
`serving`: each source's description of its features) and the `recsys-data` tools (`tools`).

Each source is a builder and its `DataConfig` subclass, registered by name in `DATA_SOURCES`;
`make_dataloader(cfg, rank, world_size)` turns any of them into batches.

Names are imported on first use (PEP 562), so `import recsys_pipe.data` loads no data source and
no torchrec: a plain-torch model trains where torchrec is not installed.
"""

from __future__ import annotations

from recsys_pipe._lazy import lazy_exports

_EXPORTS = {
    "ACTION_KEY": "batch",
    "ITEM_KEY": "batch",
    "MASKED_ACTION": "batch",
    "USER_KEY": "batch",
    "Sample": "batch",
    "SequenceBatch": "batch",
    "TensorBatch": "batch",
    "collate": "batch",
    "DataConfig": "source",
    "SequenceDataConfig": "source",
    "make_dataloader": "source",
    "EpochSampler": "source",
    "PositionalSource": "source",
    "RankData": "source",
    "DataSpec": "batch",
    "DATA_SOURCES": "registry",
    "MovieLensDataConfig": "in_memory.movielens",
    "MovieLensDataset": "in_memory.movielens",
    "read_ratings": "in_memory.movielens",
    "SyntheticConfig": "in_memory.synthetic",
    "SyntheticDataConfig": "in_memory.synthetic",
    "SyntheticSequenceDataset": "in_memory.synthetic",
    "CriteoBatch": "batch",
    "CriteoDataConfig": "in_memory.criteo",
    "CriteoDataset": "in_memory.criteo",
    "CriteoSyntheticConfig": "in_memory.criteo",
    "CriteoSyntheticDataConfig": "in_memory.criteo",
    "CriteoSyntheticDataset": "in_memory.criteo",
    "CriteoLayoutConfig": "in_memory.criteo",
    "TabularBatch": "batch",
    "TabularDataConfig": "source",
    "read_criteo": "text.criteo_tsv",
    "CriteoRows": "text.criteo_tsv",
    "CsvConfig": "text.interactions",
    "convert_criteo": "tools.convert",
    "convert_sequences": "tools.convert",
    "DataFileError": "parquet.files",
    "ParquetFiles": "parquet.files",
    "open_parquet": "parquet.files",
    "ParquetDataConfig": "parquet.tabular",
    "SparseColumn": "parquet.tabular",
    "TabularColumns": "parquet.tabular",
    "ITEM_VOCAB_KEY": "parquet.decode",
    "ParquetSequenceKeys": "parquet.sequences",
    "ParquetSequencesDataConfig": "parquet.sequences",
    "ParquetRankingDataConfig": "parquet.ranking",
    "USER_VOCAB_KEY": "parquet.ranking",
    "WINDOWS_KEY": "parquet.decode",
    "user_vocab_metadata": "parquet.ranking",
    "windows_metadata": "parquet.ranking",
    "SequenceColumns": "parquet.decode",
    "item_vocab_metadata": "parquet.decode",
    "Layout": "parquet.stream",
    "StreamSource": "parquet.stream",
    "describe": "tools.inspect",
    "RetrievalBatch": "batch",
    "SequencesDataConfig": "in_memory.sequences",
    "SequenceSourceConfig": "source",
    "SequencesDataset": "in_memory.sequences",
    "read_interactions": "in_memory.sequences",
    "unseen_items": "negatives",
    "ServedSource": "serving",
    "served_source": "serving",
    "preprocess_file": "serving",
    "FEATURES_FORMAT": "serving",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
