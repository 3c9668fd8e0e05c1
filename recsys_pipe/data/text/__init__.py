"""Text parsers: line-aligned chunks of text files parsed by pyarrow with `<file>:<line>` errors
(`files`), Criteo TSV rows (`criteo_tsv`) and interaction files (`interactions`). They import no
torch: the in-memory sources and the `recsys-data` converters share them."""
