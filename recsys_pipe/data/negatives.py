"""Negative items of next-item retrieval: items a user never interacted with, drawn uniformly by
a counter-based hash, for whole batches of users at once.

One function, `unseen_items`, draws the training negatives (one per target, drawn again every
epoch) and the evaluation negatives (the sampled protocol's candidates) of `data=sequences` and
`data=parquet_sequences`, so both sources give bitwise equal batches.

How a negative is drawn. Every user gets a 64-bit key from its counters, chained through
SplitMix64's output function (`recsys_pipe.data.ids.splitmix64`, a bijection on 64-bit words):
`key = f(f(f(f(seed) ^ domain) ^ epoch) ^ user)`. The domain keeps the streams apart (`TRAIN`:
the training negatives of `epoch`; `EVAL`: the evaluation negatives, with epoch 0, the same at
every evaluation). Position `j`'s attempt `r` draws the candidate `f(key ^ (r << 32 | j)) mod
num_items`; a candidate among the user's seen items is rejected, and position `j` takes attempt
`r + 1`, until one is accepted. So position `j`'s negative is uniform over the user's unseen items
and depends only on (seed, domain, epoch, user, j, the seen items): never on the batch the user is
in, the other users, the rank or worker count or the order of access. Resume stays exact, and a
user drawn alone gets what it gets inside any batch. Draws are with replacement across positions.

Bias. `h mod n` of a uniform 64-bit `h` gives every item a probability within `2^-64` of `1/n`
(each residue is hit `floor(2^64 / n)` or `ceil(2^64 / n)` times out of `2^64`): a relative bias
of at most `n / 2^64`, below `2^-32` for any catalogue under four billion items. SplitMix64's
output function passes BigCrush on counters (Steele, Lea & Flood 2014), which is what it is
given here. numpy's `Generator` cannot be keyed per (user, position, attempt) and vectorised at
once: seeding one per user cost ~10 us, more than the draw.

Membership is a bitmap of a few users' rows of `num_items` booleans at a time (their seen items
set, the candidates looked up, the bits cleared again); each round redraws only the rejected
positions, and looks up only their users. A user whose seen items cover
the whole catalogue has no negative: a `ConfigError` at `data.path`. Termination is certain with
probability one: a position with `k` unseen items of `n` is still open after `r` rounds with
probability `(1 - k/n)^r`.
"""

from __future__ import annotations

import numpy as np

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.data.ids import splitmix64, splitmix64_inplace
from recsys_pipe.data.jagged import concat_ranges

__all__ = ["EVAL", "TRAIN", "unseen_items"]

TRAIN = 0
"""The domain of the training negatives (drawn again every epoch)."""
EVAL = 1
"""The domain of the evaluation negatives (epoch 0: the same at every evaluation)."""

_U64 = 1 << 64
_POSITION_BITS = 32


def _word(value: int) -> np.ndarray:
    """A Python integer as one uint64 word (two's complement modulo 2^64)."""
    return np.array([value % _U64], dtype=np.uint64)


def _user_keys(seed: int, domain: int, epoch: int, users: np.ndarray) -> np.ndarray:
    """Each user's 64-bit key of `(seed, domain, epoch)` (see the module docstring)."""
    k = splitmix64(_word(seed))
    k = splitmix64(k ^ _word(domain))
    k = splitmix64(k ^ _word(epoch))
    return splitmix64(np.asarray(users, dtype=np.int64).view(np.uint64) ^ k)


def unseen_items(
    seed: int,
    domain: int,
    epoch: int,
    users: np.ndarray,
    counts: np.ndarray,
    seen: np.ndarray,
    seen_starts: np.ndarray,
    seen_lengths: np.ndarray,
    num_items: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """`counts[i]` items of `[0, num_items)` for user `users[i]`, none among its seen items
    `seen[seen_starts[i]:seen_starts[i] + seen_lengths[i]]`, uniform and with replacement.

    Args:
        seed: `data.seed`.
        domain: `TRAIN` or `EVAL`.
        epoch: the training epoch (0 for `EVAL`).
        users: `[U]` the users' ids (dense user ids: the same user has the same id in every source).
        counts: `[U]` negatives per user.
        seen: dense item ids holding every user's seen items (any order, repeats allowed).
        seen_starts, seen_lengths: `[U]` where each user's seen items are in `seen`.
        num_items: the catalogue size.
        out: the int64 array of `sum(counts)` to write them into (None: a new one).

    Returns:
        `[sum(counts)]` int64: user 0's negatives, then user 1's, ... (positions in order).
    """
    users = np.asarray(users, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    seen = np.asarray(seen, dtype=np.int64)
    starts = np.asarray(seen_starts, dtype=np.int64)
    lengths = np.asarray(seen_lengths, dtype=np.int64)
    total = int(counts.sum())
    if out is None:
        out = np.empty(total, dtype=np.int64)
    if not total:
        return out
    if int(counts.max()) >= 1 << _POSITION_BITS:
        raise ValueError(f"at most {(1 << _POSITION_BITS) - 1} negatives per user")
    _check_unseen_exist(seen, starts, lengths, counts, num_items)

    first = np.cumsum(counts) - counts
    position = concat_ranges(np.zeros(len(counts), dtype=np.int64), counts)
    key = np.repeat(_user_keys(seed, domain, epoch, users), counts)
    _candidates(key, position.view(np.uint64), num_items, out.view(np.uint64))  # attempt 0 of every position
    seen_bits = _SeenBits(seen, starts, lengths, num_items)
    open_ = np.flatnonzero(seen_bits.contains(np.arange(len(users)), counts, out))
    attempt = 1
    while len(open_):  # the rejected positions' next attempts
        word = position[open_].view(np.uint64) | np.uint64(attempt << _POSITION_BITS)
        candidate = _candidates(key[open_], word, num_items)
        owner = np.searchsorted(first, open_, side="right") - 1  # nondecreasing, as open_
        starts_at = np.flatnonzero(np.diff(owner, prepend=-1))
        per_user = np.diff(starts_at, append=len(owner))
        hit = seen_bits.contains(owner[starts_at], per_user, candidate)
        out[open_[~hit]] = candidate[~hit]
        open_ = open_[hit]
        attempt += 1
    return out


def _candidates(key: np.ndarray, word: np.ndarray, num_items: int, out: np.ndarray | None = None) -> np.ndarray:
    """`splitmix64(key ^ word) mod num_items`, as int64 (written into the uint64 array `out`, if
    given). The remainder is `h - (h // n) * n`: numpy divides a uint64 array by a scalar with
    a multiplication (libdivide), while its `%` divides each element, ten times slower."""
    h = np.bitwise_xor(key, word, out=out)
    splitmix64_inplace(h)
    n = np.uint64(num_items)
    quotient = h // n
    quotient *= n
    h -= quotient
    return h.view(np.int64)


#: the most bytes of the seen-items bitmap set at once (a few users' rows: stays in cache)
_BITMAP_BYTES = 1 << 21


class _SeenBits:
    """Whether items are among users' seen items: a bitmap of `[users, n]` booleans, for the
    `per` users of one chunk at a time (set their seen items, look the queries up, clear them
    again): two scatters and one gather per item, no sort (sorting the batch's `user * n + item`
    keys for `np.searchsorted` gives the same answers some 30x slower). Each user's bitmap keys
    are computed once, for every round of redraws."""

    def __init__(self, seen: np.ndarray, starts: np.ndarray, lengths: np.ndarray, n: int) -> None:
        self.per = max(1, _BITMAP_BYTES // n)
        self.row = np.arange(len(lengths), dtype=np.int64) % self.per * n  # each user's row in its chunk
        self.keys = np.repeat(self.row, lengths)
        self.keys += seen[concat_ranges(starts, lengths)]
        self.key_at = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.key_at[1:])
        self.bitmap = np.zeros(min(self.per, len(lengths)) * n, dtype=bool)

    def contains(self, users: np.ndarray, counts: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Whether each of `items` (`counts[i]` of them for user `users[i]`, users ascending, in
        that order) is among its user's seen items."""
        per, key_at, bitmap = self.per, self.key_at, self.bitmap
        queries = np.repeat(self.row[users], counts)
        queries += items
        query_at = np.zeros(len(users) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_at[1:])
        chunk = users // per
        bounds = np.flatnonzero(np.diff(chunk, prepend=-1, append=-1))  # where each chunk's users start
        hit = np.empty(len(items), dtype=bool)
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            c = int(chunk[a])
            these = self.keys[key_at[c * per] : key_at[min((c + 1) * per, len(key_at) - 1)]]
            bitmap[these] = True
            hit[query_at[a] : query_at[b]] = bitmap[queries[query_at[a] : query_at[b]]]
            bitmap[these] = False
        return hit


def _check_unseen_exist(
    seen: np.ndarray, starts: np.ndarray, lengths: np.ndarray, counts: np.ndarray, num_items: int
) -> None:
    """A user that needs negatives but has seen every item cannot have any."""
    for user in np.flatnonzero((lengths >= num_items) & (counts > 0)).tolist():  # rare: only such long users
        if len(np.unique(seen[starts[user] : starts[user] + lengths[user]])) >= num_items:
            raise ConfigError(ConfigProblem("data.path", f"a user interacted with all {num_items} items: no negatives"))
