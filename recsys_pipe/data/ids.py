"""Ids of sparse features mapped into a table's `[0, n)` rows, vectorised and stable.

`hash` mode gives every raw id the same row on every run and machine: a raw 64-bit integer is
mixed with SplitMix64's finaliser (Steele, Lea & Flood 2014; the same constants everywhere), a
string is first folded to 64 bits with FNV-1a over its UTF-8 bytes; the row is the mixed value
modulo `n`. Both are fixed arithmetic on uint64 (numpy wraps around), never Python's `hash`,
which is salted per process. Python's `hashlib` would be as stable but works one value at a time;
these run over whole columns.

The kernels live in `recsys_pipe.data.preprocess`, the file an export ships for serving: training
and serving hash with the same code. This module reads Arrow's string buffers into them.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_pipe.data.preprocess import fnv1a64 as _fnv1a64_bytes
from recsys_pipe.data.preprocess import splitmix64, splitmix64_inplace

__all__ = ["fnv1a64", "splitmix64", "splitmix64_inplace", "string_ids"]


def fnv1a64(strings: pa.Array) -> np.ndarray:
    """FNV-1a (64-bit) of each string's UTF-8 bytes, column-wise, read from the Arrow buffers."""
    strings = pc.cast(strings, pa.large_binary())
    n = len(strings)
    offsets = np.frombuffer(strings.buffers()[1], dtype=np.int64)[strings.offset : strings.offset + n + 1]
    data = (
        np.frombuffer(strings.buffers()[2], dtype=np.uint8)
        if strings.buffers()[2] is not None
        else np.zeros(0, np.uint8)
    )
    return _fnv1a64_bytes(data, offsets)


def string_ids(strings: pa.Array) -> np.ndarray:
    """Stable 64-bit ids of strings (FNV-1a), as int64 bit patterns."""
    return fnv1a64(strings).view(np.int64)
