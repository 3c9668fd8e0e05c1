"""Ids of sparse features mapped into a table's `[0, n)` rows, vectorised and stable.

`hash` mode gives every raw id the same row on every run and machine: a raw 64-bit integer is
mixed with SplitMix64's finaliser (Steele, Lea & Flood 2014; the same constants everywhere), a
string is first folded to 64 bits with FNV-1a over its UTF-8 bytes; the row is the mixed value
modulo `n`. Both are fixed arithmetic on uint64 (numpy wraps around), never Python's `hash`,
which is salted per process. Python's `hashlib` would be as stable but works one value at a time;
these run over whole columns.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["fnv1a64", "splitmix64", "splitmix64_inplace", "string_ids"]

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


def splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of `values` (any integer dtype, viewed as uint64), as a new
    uint64 array."""
    return splitmix64_inplace(values.astype(np.int64).view(np.uint64))


def splitmix64_inplace(words: np.ndarray) -> np.ndarray:
    """SplitMix64's output function applied to the uint64 array `words` in place (one scratch
    array: two passes of memory per step, not three new arrays); returns `words`."""
    scratch = np.empty_like(words)
    words += np.uint64(0x9E3779B97F4A7C15)
    for shift, multiplier in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        np.right_shift(words, np.uint64(shift), out=scratch)
        words ^= scratch
        words *= np.uint64(multiplier)
    np.right_shift(words, np.uint64(31), out=scratch)
    words ^= scratch
    return words


def fnv1a64(strings: pa.Array) -> np.ndarray:
    """FNV-1a (64-bit) of each string's UTF-8 bytes, column-wise: one numpy pass per byte
    position up to the longest string, not one Python call per value."""
    strings = pc.cast(strings, pa.large_binary())
    n = len(strings)
    offsets = np.frombuffer(strings.buffers()[1], dtype=np.int64)[strings.offset : strings.offset + n + 1]
    data = (
        np.frombuffer(strings.buffers()[2], dtype=np.uint8)
        if strings.buffers()[2] is not None
        else np.zeros(0, np.uint8)
    )
    starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
    h = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    longest = int(lengths.max()) if n else 0
    with np.errstate(over="ignore"):
        for j in range(longest):
            live = lengths > j
            byte = np.zeros(n, dtype=np.uint64)
            byte[live] = data[starts[live] + j]
            h = np.where(live, (h ^ byte) * _FNV_PRIME, h)
    return h


def string_ids(strings: pa.Array) -> np.ndarray:
    """Stable 64-bit ids of strings (FNV-1a), as int64 bit patterns."""
    return fnv1a64(strings).view(np.int64)
