"""Jagged arrays as numpy: a flat array of values and, per row, where its values are (offsets,
or starts and lengths). The helpers the Parquet sources and the negative sampler share."""

from __future__ import annotations

import numpy as np

__all__ = ["concat_ranges", "offsets_of"]


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    """The int64 offsets `[len(lengths) + 1]` of rows of `lengths` (0, then their running sum)."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def concat_ranges(starts: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The concatenation of `arange(s, s + n)` for each start `s` and length `n`, vectorised:
    each range's shift from its place in the output, repeated, plus one `arange` (written into
    `out`, an int64 array of `sum(lengths)`, if given)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    shift = np.asarray(starts, dtype=np.int64) - (ends - lengths)
    if out is None:
        out = np.repeat(shift, lengths)
        out += _arange(total)
        return out
    return np.add(np.repeat(shift, lengths), _arange(total), out=out)


#: `arange` up to this many elements is a view of one array kept for the next call (a part of a
#: window makes its ranges again and again: no fresh memory each time), longer ones are made
_KEPT_ARANGE = 1 << 21
_ARANGE = np.arange(0, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    global _ARANGE
    if n > _KEPT_ARANGE:
        return np.arange(n, dtype=np.int64)
    if len(_ARANGE) < n:
        _ARANGE = np.arange(max(n, min(2 * len(_ARANGE), _KEPT_ARANGE)), dtype=np.int64)
    return _ARANGE[:n]
