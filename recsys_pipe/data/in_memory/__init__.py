"""In-memory sources: each rank reads (or generates) its share and keeps it in memory as a
map-style dataset. Synthetic user histories and MovieLens windows (HSTU ranking), Criteo TSV and
a generated Criteo-like source (DLRM), per-user item sequences (next-item retrieval)."""
