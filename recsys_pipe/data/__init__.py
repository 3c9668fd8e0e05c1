"""Data sources and batches: synthetic sequences and MovieLens (for HSTU), Criteo files and a
generated Criteo-like source (for DLRM), and per-user item sequences for next-item retrieval
(`data=sequences`, for SASRec and HSTU retrieval), and Parquet files of any size streamed by
position (`data=parquet`: tabular rows; `data=parquet_sequences`: per-user sequences for
next-item retrieval, or windows of ratings for HSTU ranking, whichever the model trains on; see
`recsys_pipe.data.stream`).

Each source is a builder and its `DataConfig` subclass, registered by name in `DATA_SOURCES`;
`make_dataloader(cfg, rank, world_size)` turns any of them into batches. The batch protocol is
written down in `recsys_pipe.data.batch`.

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
    "DataConfig": "loader",
    "SequenceDataConfig": "loader",
    "make_dataloader": "loader",
    "EpochSampler": "loader",
    "PositionalSource": "loader",
    "RankData": "loader",
    "DataSpec": "spec",
    "DATA_SOURCES": "registry",
    "MovieLensDataConfig": "movielens",
    "MovieLensDataset": "movielens",
    "read_ratings": "movielens",
    "SyntheticConfig": "synthetic",
    "SyntheticDataConfig": "synthetic",
    "SyntheticSequenceDataset": "synthetic",
    "CriteoBatch": "criteo",
    "CriteoDataConfig": "criteo",
    "CriteoDataset": "criteo",
    "CriteoSyntheticConfig": "criteo",
    "CriteoSyntheticDataConfig": "criteo",
    "CriteoSyntheticDataset": "criteo",
    "CriteoLayoutConfig": "criteo",
    "TabularBatch": "tabular",
    "TabularDataConfig": "tabular",
    "read_criteo": "criteo_tsv",
    "CriteoRows": "criteo_tsv",
    "CsvConfig": "interactions_file",
    "convert_criteo": "convert",
    "convert_sequences": "convert",
    "DataFileError": "parquet_files",
    "ParquetFiles": "parquet_files",
    "open_parquet": "parquet_files",
    "ParquetDataConfig": "parquet",
    "SparseColumn": "parquet",
    "TabularColumns": "parquet",
    "ITEM_VOCAB_KEY": "parquet_sequences",
    "ParquetSequenceKeys": "parquet_sequences",
    "ParquetSequencesDataConfig": "parquet_sequences",
    "ParquetRankingDataConfig": "parquet_ranking",
    "USER_VOCAB_KEY": "parquet_ranking",
    "WINDOWS_KEY": "parquet_ranking",
    "user_vocab_metadata": "parquet_ranking",
    "windows_metadata": "parquet_ranking",
    "SequenceColumns": "parquet_sequences",
    "item_vocab_metadata": "parquet_sequences",
    "Layout": "stream",
    "StreamSource": "stream",
    "describe": "inspect",
    "RetrievalBatch": "sequences",
    "SequencesDataConfig": "sequences",
    "SequenceSourceConfig": "sequences",
    "SequencesDataset": "sequences",
    "read_interactions": "sequences",
    "unseen_items": "negatives",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
