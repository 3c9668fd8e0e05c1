"""The `recsys-data` tools: converters of the text formats to Parquet (`convert`) and what a
Parquet data set holds and how ranks would share it (`inspect`)."""
