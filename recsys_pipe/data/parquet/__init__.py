"""Parquet sources streamed by position: the files and their checks (`files`), the shared
streaming machinery (`stream`: which rows each rank trains, read in windows by worker
processes), tabular rows (`tabular`, `data=parquet`), per-user sequences for next-item retrieval
(`sequences`, `data=parquet_sequences`) and HSTU ranking windows over the same files (`ranking`)."""
