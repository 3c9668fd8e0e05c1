"""MovieLens ratings -> per-user interaction sequences -> `Sample`.

Reads both public layouts: ml-1m `ratings.dat` (`UserID::MovieID::Rating::Timestamp`, no
header) and ml-20m/25m `ratings.csv` (header `userId,movieId,rating,timestamp`). Each user's
ratings are sorted by time and cut, from the most recent end, into windows of at most
`max_seq_len` ratings (kept in time order); the last `num_candidates` ratings of a window are the ranking
candidates. The action of a rating is `round(2 * rating)` (half stars in ml-20m), so actions
are `1..10` and `0` stays the masked candidate action; task `k` is `rating >= thresholds[k]`.

Movie and user ids are remapped to dense `[0, n)` in sorted raw-id order. Pure Python: ml-1m
loads in a few seconds, ml-20m in a minute or so.
"""

from __future__ import annotations

import codecs
import csv
from collections import defaultdict
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import ClassVar, Literal, NoReturn

from pydantic import Field, StrictStr, field_validator
from torch.utils.data import Dataset

from recsys_pipe.config import ConfigError, ConfigProblem, builder_field
from recsys_pipe.data.batch import ACTION_KEY, ITEM_KEY, USER_KEY, Sample, collate
from recsys_pipe.data.loader import SequenceDataConfig, readable_file
from recsys_pipe.data.spec import DataSpec

__all__ = ["MovieLensDataConfig", "MovieLensDataset", "movielens_dataset", "read_ratings"]

Rating = tuple[int, int, float, int]
"""(user id, movie id, rating, unix timestamp) as found in the file."""

NUM_ACTIONS = 11


#: timestamps must fit in int64 with room for differences between two of them
MAX_TIMESTAMP = 2**62
_LAYOUT = (
    "expected MovieLens ratings: ml-1m `UserID::MovieID::Rating::Timestamp` lines, or ml-20m/25m CSV "
    "with the header `userId,movieId,rating,timestamp`"
)


def read_ratings(path: str | Path) -> list[Rating]:
    """Parse a MovieLens ratings file; the layout is detected from its first line.

    A file that is not one (binary, another CSV, empty) or a bad row is a ConfigError at
    `data.path` naming the file and line, so `recsys-train` reports it in one line (exit 2).
    """
    path = Path(path)
    try:
        with path.open("rb") as raw:
            head = raw.read(8192)
        if b"\0" in head:
            _fail(path, None, f"a binary file, not text; {_LAYOUT}")
        # A byte order mark (spreadsheet exports write one) is not part of the first line. Bytes are
        # read as latin-1 so that a stray non-UTF-8 byte cannot fail the parse of numeric fields.
        start = len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0
        with path.open(newline="", encoding="latin-1") as f:
            f.seek(start)
            first = f.readline()
            f.seek(start)
            if "::" in first:
                rows = ((n, line.rstrip("\r\n").split("::")) for n, line in enumerate(f, 1) if line.strip())
            elif first.lower().startswith("userid,"):
                reader = csv.reader(f)
                next(reader)
                rows = ((reader.line_num, r) for r in reader if r)
            elif not first.strip():
                _fail(path, None, f"the file is empty; {_LAYOUT}")
            else:
                _fail(path, 1, f"unrecognised first line {_excerpt(first)}; {_LAYOUT}")
            ratings = [_rating(path, n, row) for n, row in rows]
    except OSError as exc:
        _fail(path, None, f"cannot read the file ({exc.strerror or exc})")
    if not ratings:
        _fail(path, None, "the file has no ratings (header only)")
    return ratings


def _rating(path: Path, line: int, row: list[str]) -> Rating:
    if len(row) != 4:
        _fail(path, line, f"expected 4 fields (user, movie, rating, timestamp), got {len(row)}: {_excerpt(row)}")
    user, movie, rating, stamp = row
    try:
        parsed = (int(user), int(movie), float(rating), int(stamp))
    except ValueError:
        _fail(path, line, f"fields must be integer user, movie, timestamp and a numeric rating: {_excerpt(row)}")
    if not 0 < parsed[2] <= 5:  # MovieLens stars; also refuses nan and inf
        _fail(path, line, f"rating {rating!r} is outside (0, 5]")
    if not 0 <= parsed[3] < MAX_TIMESTAMP:
        _fail(path, line, f"timestamp {stamp!r} is not a unix time in seconds")
    return parsed


def _excerpt(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(path: Path, line: int | None, message: str) -> NoReturn:
    where = f"{path}:{line}" if line is not None else str(path)
    raise ConfigError(ConfigProblem("data.path", f"{where}: {message}"))


def _user_sequences(ratings: Sequence[Rating]) -> tuple[dict[int, list[Rating]], dict[int, int], dict[int, int]]:
    """Group by user, sort each by (timestamp, movie), and build dense id maps."""
    by_user: dict[int, list[Rating]] = defaultdict(list)
    for r in ratings:
        by_user[r[0]].append(r)
    for seq in by_user.values():
        seq.sort(key=lambda r: (r[3], r[1]))
    movie_index = {m: i for i, m in enumerate(sorted({r[1] for r in ratings}))}
    user_index = {u: i for i, u in enumerate(sorted(by_user))}
    return by_user, movie_index, user_index


class MovieLensDataConfig(SequenceDataConfig):
    """`data=movielens`: a MovieLens ratings file (`data.path`, ratings.dat or ratings.csv)."""

    SIZE_KEY: ClassVar[str] = "data.path"

    name: Literal["movielens"] = "movielens"
    builder: StrictStr | None = builder_field("recsys_pipe.data.movielens:movielens_dataset")
    path: StrictStr = Field(description="MovieLens ratings.dat (ml-1m) or ratings.csv (ml-20m/25m)")

    _readable_file = field_validator("path")(readable_file)


def movielens_dataset(cfg: MovieLensDataConfig, rank: int, world_size: int) -> MovieLensDataset:
    """Builder of `data=movielens`: this rank's share of the rating windows."""
    return MovieLensDataset(
        cfg.path, cfg.max_seq_len, cfg.num_candidates, rank, world_size, use_user_feature=cfg.use_user_feature
    )


class MovieLensDataset(Dataset[Sample]):
    """This rank's share of the MovieLens windows (rank `r` of `w` gets every w-th window).

    Args:
        path: `ratings.dat` (ml-1m) or `ratings.csv` (ml-20m).
        max_seq_len: max ratings per window (history + candidates).
        num_candidates: trailing ratings of each window that are ranking candidates.
        thresholds: one binary task per threshold, positive when `rating >= threshold`.
        min_history: windows with fewer history ratings are dropped.
        use_user_feature: whether batches carry the user id (the spec then sizes a user table).
    """

    def __init__(
        self,
        path: str | Path,
        max_seq_len: int,
        num_candidates: int,
        rank: int = 0,
        world_size: int = 1,
        thresholds: Sequence[float] = (4.0, 5.0),
        min_history: int = 1,
        use_user_feature: bool = False,
    ) -> None:
        if not 0 < num_candidates < max_seq_len:
            raise ValueError(f"need 0 < num_candidates ({num_candidates}) < max_seq_len ({max_seq_len})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        by_user, movie_index, user_index = _user_sequences(read_ratings(path))
        self.thresholds = tuple(thresholds)
        self.rank = rank
        self.world_size = world_size
        vocab = {ITEM_KEY: len(movie_index), ACTION_KEY: NUM_ACTIONS}
        if use_user_feature:
            vocab[USER_KEY] = len(user_index)
        self.spec = DataSpec(num_tasks=len(self.thresholds), vocab_sizes=vocab)
        self.collate = partial(collate, use_user_feature=use_user_feature)
        min_len = num_candidates + min_history
        self._windows: list[tuple[int, list[Rating]]] = []
        for raw_user in sorted(by_user):
            seq = by_user[raw_user]
            ends = range(len(seq), min_len - 1, -max_seq_len)  # newest window first ...
            for end in reversed(ends):  # ... stored oldest first
                self._windows.append((user_index[raw_user], seq[max(0, end - max_seq_len) : end]))
        self._movie_index = movie_index
        self._num_candidates = num_candidates

    @property
    def num_windows(self) -> int:
        """Windows over all ranks (before the per-rank split)."""
        return len(self._windows)

    def __len__(self) -> int:
        return len(self._windows) // self.world_size

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self):
            raise IndexError(index)
        global_index = index * self.world_size + self.rank
        user, window = self._windows[global_index]
        n_hist = len(window) - self._num_candidates
        return Sample(
            sample_id=global_index,
            user=user,
            items=[self._movie_index[r[1]] for r in window],
            timestamps=[r[3] for r in window],
            history_actions=[round(2 * r[2]) for r in window[:n_hist]],
            labels=[[float(r[2] >= th) for th in self.thresholds] for r in window[n_hist:]],
        )
