"""MovieLens ratings -> per-user interaction sequences -> `Sample`.

Reads both public layouts: ml-1m `ratings.dat` (`UserID::MovieID::Rating::Timestamp`, no
header) and ml-20m/25m `ratings.csv` (header `userId,movieId,rating,timestamp`), and any other
delimited file of user, item, rating and timestamp columns (`data.csv.*`, with or without a
header; see `recsys_pipe.data.text.interactions`). Each user's
ratings are sorted by time and cut, from the most recent end, into windows of at most
`max_seq_len` ratings (kept in time order); the last `num_candidates` ratings of a window are the ranking
candidates. The action of a rating is `round(2 * rating)` (half stars in ml-20m), so actions
are `1..10` and `0` stays the masked candidate action; task `k` is `rating >= data.thresholds[k]`
(default `[4, 5]`: "liked" and "loved").

Movie and user ids are remapped to dense `[0, n)` in sorted raw-id order. The file is parsed by
pyarrow; every rank reads all of it (the windows and the id maps need every rating) and keeps
every `world_size`-th window.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal, NoReturn

from pydantic import Field, StrictStr, field_validator
from torch.utils.data import Dataset

from recsys_pipe.config import builder_field
from recsys_pipe.data.batch import ACTION_KEY, ITEM_KEY, USER_KEY, DataSpec, Sample, collate
from recsys_pipe.data.serving import RATING_ACTIONS, SEQUENCE_COLUMNS, id_record, sequence_features
from recsys_pipe.data.source import SequenceDataConfig, readable_file
from recsys_pipe.data.text.files import fail
from recsys_pipe.data.text.interactions import CsvConfig, detect_layout, has_string_ids, read_interaction_columns

__all__ = ["MovieLensDataConfig", "MovieLensDataset", "movielens_dataset", "read_ratings"]

Rating = tuple[int, int, float, int]
"""(user id, movie id, rating, unix timestamp) as found in the file."""

NUM_ACTIONS = 11


_LAYOUT = (
    "expected MovieLens ratings: ml-1m `UserID::MovieID::Rating::Timestamp` lines, or ml-20m/25m CSV "
    "with the header `userId,movieId,rating,timestamp`"
)


def read_ratings(path: str | Path, csv: CsvConfig | None = None) -> list[Rating]:
    """Parse a MovieLens ratings file (or any delimited file with user, item, rating and timestamp
    columns, named by `csv`; by default the layout is detected from the first line).

    A file that is not one (binary, another CSV, empty) or a bad row is a ConfigError at
    `data.path` naming the file and line, so `recsys-train` reports it in one line (exit 2).
    """
    path = str(path)
    layout = detect_layout(path, csv or CsvConfig(), _LAYOUT)
    if not layout.roles:
        _fail(path, None, f"the file is empty; {_LAYOUT}")
    missing = [r for r in ("rating", "timestamp") if r not in layout.roles]
    if missing:
        _fail(path, 1, f"no {' and no '.join(missing)} column (columns: {list(layout.roles)}); {_LAYOUT}")
    columns = read_interaction_columns(path, layout, _LAYOUT, string_ids=has_string_ids(path, layout))
    if not len(columns):
        _fail(path, None, "the file has no ratings (header only)")
    assert columns.rating is not None and columns.timestamp is not None
    return list(zip(columns.user.tolist(), columns.item.tolist(), columns.rating.tolist(), columns.timestamp.tolist()))


def _fail(path: str | Path, line: int | None, message: str) -> NoReturn:
    fail(str(path), line, message)


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
    builder: StrictStr | None = builder_field("recsys_pipe.data.in_memory.movielens:movielens_dataset")
    path: StrictStr = Field(
        description="MovieLens ratings.dat (ml-1m) or ratings.csv (ml-20m/25m), or any delimited file of user, item, "
        "rating and timestamp columns (data.csv.*)"
    )
    csv: CsvConfig = Field(default_factory=CsvConfig, description="how the file's columns are read")
    thresholds: list[float] = Field(
        [4.0, 5.0],
        min_length=1,
        description="one binary task per threshold: a candidate is positive for task k when its rating >= "
        "thresholds[k]",
    )

    _readable_file = field_validator("path")(readable_file)


def movielens_dataset(cfg: MovieLensDataConfig, rank: int, world_size: int) -> MovieLensDataset:
    """Builder of `data=movielens`: this rank's share of the rating windows."""
    return MovieLensDataset(
        cfg.path,
        cfg.max_seq_len,
        cfg.num_candidates,
        rank,
        world_size,
        thresholds=cfg.thresholds,
        use_user_feature=cfg.use_user_feature,
        csv=cfg.csv,
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
        csv: how the file's columns are read (default: detected).
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
        csv: CsvConfig | None = None,
    ) -> None:
        if not 0 < num_candidates < max_seq_len:
            raise ValueError(f"need 0 < num_candidates ({num_candidates}) < max_seq_len ({max_seq_len})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        by_user, movie_index, user_index = _user_sequences(read_ratings(path, csv))
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
        self._max_seq_len = max_seq_len
        self._raw_users = sorted(user_index) if use_user_feature else None

    def serving_features(self) -> dict[str, Any]:
        """Movies and users through their sorted raw ids, ratings as action ids (`recsys_pipe.data.serving`)."""
        items = id_record("vocabulary", len(self._movie_index), sorted(self._movie_index))
        users = None if self._raw_users is None else id_record("vocabulary", len(self._raw_users), self._raw_users)
        return sequence_features(items, RATING_ACTIONS, True, self._max_seq_len, self._num_candidates, users)

    def raw_rows(self, sample_ids: Sequence[int], split: str | None) -> list[dict[str, Any]]:
        """The windows `sample_ids` (global indices) as rows of raw ids, ratings and times."""
        columns = SEQUENCE_COLUMNS
        return [
            {
                columns["user"]: window[0][0],
                columns["items"]: [r[1] for r in window],
                columns["timestamps"]: [r[3] for r in window],
                columns["actions"]: [r[2] for r in window],
            }
            for window in (self._windows[int(i)][1] for i in sample_ids)
        ]

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
