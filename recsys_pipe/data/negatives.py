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
from recsys_pipe.data.ids import splitmix64

__all__ = ["EVAL", "TRAIN", "concat_ranges", "unseen_items"]

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


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of `arange(s, s + n)` for each start `s` and length `n`, vectorised:
    each range's shift from its place in the output, repeated, plus one `arange`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    out = np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lengths), lengths)
    out += np.arange(total, dtype=np.int64)
    return out


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

    Returns:
        `[sum(counts)]` int64: user 0's negatives, then user 1's, ... (positions in order).
    """
    users = np.asarray(users, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    seen = np.asarray(seen, dtype=np.int64)
    starts = np.asarray(seen_starts, dtype=np.int64)
    lengths = np.asarray(seen_lengths, dtype=np.int64)
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    if int(counts.max()) >= 1 << _POSITION_BITS:
        raise ValueError(f"at most {(1 << _POSITION_BITS) - 1} negatives per user")
    _check_unseen_exist(seen, starts, lengths, counts, num_items)

    first = np.zeros(len(users), dtype=np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    owner = np.repeat(np.arange(len(users), dtype=np.int64), counts)
    position = np.arange(total, dtype=np.int64)
    position -= first[owner]
    key = np.repeat(_user_keys(seed, domain, epoch, users), counts)
    out = _candidates(key, position.view(np.uint64), num_items)  # attempt 0 of every position
    open_ = np.flatnonzero(_seen(owner, out, seen, starts, lengths, num_items))
    attempt = 1
    while len(open_):  # the rejected positions' next attempts
        word = position[open_].view(np.uint64) | np.uint64(attempt << _POSITION_BITS)
        candidate = _candidates(key[open_], word, num_items)
        hit = _seen(owner[open_], candidate, seen, starts, lengths, num_items)
        out[open_[~hit]] = candidate[~hit]
        open_ = open_[hit]
        attempt += 1
    return out


def _candidates(key: np.ndarray, word: np.ndarray, num_items: int) -> np.ndarray:
    """`splitmix64(key ^ word) mod num_items`, as int64."""
    h = splitmix64(key ^ word)
    h %= np.uint64(num_items)
    return h.view(np.int64)


#: the most bytes of the seen-items bitmap `_seen` sets at once (a few users' rows: stays in cache)
_BITMAP_BYTES = 1 << 21


def _seen(
    owner: np.ndarray, item: np.ndarray, seen: np.ndarray, starts: np.ndarray, lengths: np.ndarray, n: int
) -> np.ndarray:
    """Whether `item[k]` is among the seen items of user `owner[k]` (`owner` nondecreasing).

    A bitmap of `[users, n]` booleans, for a few users at a time: set their seen items, look the
    queries up, clear them again: two scatters and one gather per item, no sort (sorting the
    batch's `user * n + item` keys for `np.searchsorted` gives the same answer some 30x slower)."""
    hit = np.empty(len(owner), dtype=bool)
    if not len(owner):
        return hit
    query_at = np.concatenate([[0], np.flatnonzero(np.diff(owner)) + 1, [len(owner)]])
    users = owner[query_at[:-1]]
    per = max(1, _BITMAP_BYTES // n)
    local = np.arange(len(users), dtype=np.int64) % per * n  # each user's row in its chunk's bitmap
    user_lengths = lengths[users]
    keys = np.repeat(local, user_lengths)
    keys += seen[concat_ranges(starts[users], user_lengths)]
    queries = np.repeat(local, np.diff(query_at))
    queries += item
    key_at = np.zeros(len(users) + 1, dtype=np.int64)
    np.cumsum(user_lengths, out=key_at[1:])
    bitmap = np.zeros(min(per, len(users)) * n, dtype=bool)
    for c in range(0, len(users), per):
        d = min(c + per, len(users))
        these = keys[key_at[c] : key_at[d]]
        bitmap[these] = True
        hit[query_at[c] : query_at[d]] = bitmap[queries[query_at[c] : query_at[d]]]
        bitmap[these] = False
    return hit


def _check_unseen_exist(
    seen: np.ndarray, starts: np.ndarray, lengths: np.ndarray, counts: np.ndarray, num_items: int
) -> None:
    """A user that needs negatives but has seen every item cannot have any."""
    for user in np.flatnonzero((lengths >= num_items) & (counts > 0)).tolist():  # rare: only such long users
        if len(np.unique(seen[starts[user] : starts[user] + lengths[user]])) >= num_items:
            raise ConfigError(ConfigProblem("data.path", f"a user interacted with all {num_items} items: no negatives"))
