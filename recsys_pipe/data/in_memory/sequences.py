"""Next-item retrieval data (`data=sequences`): per-user item sequences, leave-one-out split.

Reads these layouts, detected from the first line (or named by `data.csv.*`; the file is parsed
by pyarrow, see `recsys_pipe.data.text.interactions`):

* SASRec's "user item" lines (two integers separated by white space), each user's lines in
  chronological order (the file order is the time order, as in SASRec's preprocessed data sets);
* MovieLens ratings files (ml-1m `ratings.dat`, ml-20m/25m `ratings.csv`), each user's ratings
  sorted by (timestamp, movie); the rating itself is ignored (an interaction is an interaction);
* any delimited file with user and item columns and an optional timestamp column (`data.csv.*`).

Split, as in SASRec (Kang & McAuley 2018): of a user's sequence `s_1 .. s_n`, `s_n` is the test
item, `s_{n-1}` the validation item, and `s_1 .. s_{n-2}` the training sequence. Users with fewer
than 3 interactions keep all of them for training and are not evaluated. Items and users are
remapped to dense `[0, n)` ids in sorted raw-id order; the raw ids are kept for the evaluation
dump. Rank `r` of `w` reads every `w`-th training user (disjoint users per rank).

A training sample is one user's last `max_seq_len` training transitions: inputs
`s_1 .. s_{m-1}`, targets `s_2 .. s_m` (the next item at each position) and negatives drawn
uniformly from the items not in the user's training sequence (SASRec's sampler): one per position,
or as many per position as the model asks (`negatives_per_target`, derived from the model's loss:
`model.negatives=per_position` draws `model.num_negatives`), position by position.
The negatives are drawn again every epoch: the training sampler numbers samples across epochs
(`resamples_per_epoch`), and each is a counter-based hash of `(data.seed, epoch, user, position)`
(`recsys_pipe.data.negatives`, shared with `data=parquet_sequences`), so a run is reproducible,
every plan trains the same batches, and a user's negatives never depend on its batch.

An evaluation sample (`split("valid" | "test")`) is a user's history before the held-out item
(the last `max_seq_len` of it), the held-out item followed by `eval_negatives` items the user
never interacted with (the same sampler in a domain of its own: the same at every evaluation),
and, with `full_eval`, the whole catalogue spread over the batch (every evaluation batch carries
every item id once, so full-corpus ranking goes through the same sharded embedding lookup as
everything else).

With `data.ids=managed` (docs/raw-ids.md) samples are drawn by dense id as above and the batches
carry each item's raw id (`RawItemCollate`: integers as the file holds them, text ids hashed into
the raw id space) for the model's managed item table.

The batches are `RetrievalBatch`es (`recsys_pipe.data.batch.retrieval`, where their keys are).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NoReturn

import numpy as np
from pydantic import Field, StrictStr, field_validator
from torch.utils.data import Dataset

from recsys_pipe.config import ConfigError, ConfigProblem, builder_field
from recsys_pipe.data.batch import INPUT_KEY, RetrievalSample, collate_retrieval, raw_item_collate
from recsys_pipe.data.ids import SequenceIds, catalogue_raw_ids
from recsys_pipe.data.negatives import EVAL, TRAIN, unseen_items
from recsys_pipe.data.serving import id_record, retrieval_features, retrieval_row
from recsys_pipe.data.source import SPLITS, SequenceSourceConfig, readable_file
from recsys_pipe.data.text.interactions import CsvConfig, detect_layout, has_string_ids, read_interaction_columns

if TYPE_CHECKING:
    pass

__all__ = [
    "Interactions",
    "SequencesDataConfig",
    "SequencesDataset",
    "read_interactions",
    "sequences_dataset",
]

_LAYOUT = (
    'expected "user item" lines (two integers, chronological per user) or a MovieLens ratings file '
    "(ratings.dat `UserID::MovieID::Rating::Timestamp`, ratings.csv with header `userId,movieId,rating,timestamp`)"
)


def _fail(path: str | Path, line: int | None, message: str) -> NoReturn:
    where = f"{path}:{line}" if line is not None else str(path)
    raise ConfigError(ConfigProblem("data.path", f"{where}: {message}"))


@dataclass
class Interactions:
    """Every user's chronological raw item ids and timestamps, users in sorted raw-id order."""

    users: list[int]
    items: list[list[int]]
    timestamps: list[list[int]]
    #: the file read (named in errors about its content)
    source: str = "the data"
    #: whether `timestamps` came from the file (else they are positions in the user's sequence)
    has_timestamps: bool = True
    #: each event's rating, where the file has a rating column
    ratings: list[list[float]] | None = None


def read_interactions(
    path: str | Path, csv: CsvConfig | None = None, rating_scale: float = 5.0, string_ids: bool | None = None
) -> Interactions:
    """Parse a "user item" file, a MovieLens ratings file or another delimited file (`csv`) into
    per-user sequences: with a timestamp column, each user's events sorted by (timestamp, item);
    without, in file order. Ratings in (0, `rating_scale`]; user and item ids integers, or text
    with `string_ids` (None: text where the file's first lines hold an id that is not an integer).

    A bad file is a `ConfigError` at `data.path` naming the file and line (`recsys-train` exits 2).
    """
    path = str(path)
    layout = detect_layout(path, csv or CsvConfig(), _LAYOUT)
    if string_ids is None:
        string_ids = bool(layout.roles) and has_string_ids(path, layout)
    columns = read_interaction_columns(path, layout, _LAYOUT, rating_scale, string_ids) if layout.roles else None
    if columns is None or not len(columns):
        _fail(path, None, f"the file has no interactions; {_LAYOUT}")
    stamps = columns.timestamp
    if stamps is not None:
        order = np.lexsort((columns.item, stamps, columns.user))
    else:
        order = np.argsort(columns.user, kind="stable")
    users, starts = np.unique(columns.user[order], return_index=True)
    bounds = [*starts.tolist()[1:], len(order)]

    def per_user(values: np.ndarray) -> list[list]:
        ordered = values[order].tolist()
        return [ordered[a:b] for a, b in zip(starts.tolist(), bounds)]

    items = per_user(columns.item)
    if stamps is not None:
        times = per_user(stamps)
    else:  # no timestamps in this layout: the position in the user's sequence stands in for time
        times = [list(range(len(seq))) for seq in items]
    ratings = per_user(columns.rating) if columns.rating is not None else None
    return Interactions(users.tolist(), items, times, path, stamps is not None, ratings)


class SequencesDataConfig(SequenceIds, SequenceSourceConfig):
    """`data=sequences`: next-item retrieval on a "user item" or MovieLens ratings file."""

    SIZE_KEY: ClassVar[str] = "data.path"

    name: Literal["sequences"] = "sequences"
    builder: StrictStr | None = builder_field("recsys_pipe.data.in_memory.sequences:sequences_dataset")
    path: StrictStr = Field(
        description='"user item" lines (SASRec format), MovieLens ratings.dat / ratings.csv, or any delimited file of '
        "user, item [and timestamp] columns (data.csv.*)"
    )
    csv: CsvConfig = Field(default_factory=CsvConfig, description="how the file's columns are read")

    _readable_file = field_validator("path")(readable_file)


def sequences_dataset(cfg: SequencesDataConfig, rank: int, world_size: int) -> SequencesDataset:
    """Builder of `data=sequences`: this rank's training users (`.split(name)`: its evaluation users)."""
    return SequencesDataset(
        read_interactions(cfg.path, cfg.csv),
        cfg.max_seq_len,
        rank,
        world_size,
        seed=cfg.seed,
        eval_negatives=cfg.eval_negatives,
        full_eval=cfg.full_eval,
        negatives_per_target=cfg.negatives_per_target,
        ids=cfg,
    )


class SequencesDataset(Dataset[RetrievalSample]):
    """This rank's training users (every `world_size`-th user with at least two training items).

    Args:
        data: every user's chronological sequence.
        max_seq_len: most recent interactions a sample feeds the model.
        seed: seeds the training negatives (with the epoch and sample) and the evaluation negatives.
        eval_negatives: sampled items per evaluated user (never items the user interacted with).
        full_eval: evaluation batches carry the whole catalogue.
        negatives_per_target: training negatives per target (target by target in `negatives`).
        ids: how item ids reach the model (`data.ids`): dense, or with `managed` the raw ids of
            the file (strings hashed into the raw id space) through a managed item table: samples
            are drawn by dense id as ever and their batches carry the raw ids (`RawItemCollate`).
    """

    #: the training sampler numbers samples across epochs (`epoch * len(self) + i`), so the
    #: negatives are drawn again every epoch
    resamples_per_epoch: ClassVar[bool] = True

    def __init__(
        self,
        data: Interactions,
        max_seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        eval_negatives: int = 100,
        full_eval: bool = True,
        negatives_per_target: int = 1,
        ids: SequenceIds | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.raw_items = sorted({i for seq in data.items for i in seq})
        item_index = {raw: i for i, raw in enumerate(self.raw_items)}
        self.raw_users = data.users
        self.sequences = [[item_index[i] for i in seq] for seq in data.items]
        self.timestamps = data.timestamps
        self.has_timestamps = data.has_timestamps
        self.num_items = len(self.raw_items)
        if eval_negatives > self.num_items - 1:
            raise ConfigError(
                ConfigProblem(
                    "data.eval_negatives", f"{eval_negatives} exceeds the {self.num_items - 1} other items of the data"
                )
            )
        _check_negatives_exist(data, self.sequences, self.num_items)
        self.max_seq_len, self.rank, self.world_size, self.seed = max_seq_len, rank, world_size, seed
        self.eval_negatives, self.full_eval = eval_negatives, full_eval
        self.negatives_per_target = negatives_per_target
        self.ids = ids or SequenceIds()
        self.spec = self.ids.retrieval_spec(self.num_items)
        #: data.ids=managed: the raw id of each dense item id (None: the batches carry dense ids)
        self.catalogue = None
        if self.ids.ids == "managed":
            try:
                self.catalogue = catalogue_raw_ids(self.raw_items, self.ids.managed.input_hash_size)
            except ValueError as exc:
                _fail(data.source, None, str(exc))
        trainable = [u for u, seq in enumerate(self.sequences) if len(self._train_part(u)) >= 2]
        self._users = trainable[: len(trainable) // world_size * world_size][rank::world_size]
        self.collate = raw_item_collate(collate_retrieval, self.catalogue)
        lengths = np.array([len(self._train_part(u)) for u in range(len(self.sequences))], dtype=np.int64)
        #: every user's training items, flat, and where each user's are (`unseen_items`' seen items)
        self._train_items = np.fromiter((i for seq in self.sequences for i in seq), np.int64)
        self._train_starts = np.cumsum([0, *map(len, self.sequences[:-1])], dtype=np.int64)
        self._train_lengths = lengths

    def serving_features(self) -> dict[str, Any]:
        """Items through the sorted vocabulary of raw ids (`recsys_pipe.data.serving`)."""
        if self.catalogue is not None:  # data.ids=managed: raw ids, remapped by the program
            rows, size = self.spec.vocab_sizes[INPUT_KEY], self.ids.managed.input_hash_size
            items = id_record("managed", rows, self.raw_items, input_hash_size=size)
        else:
            items = id_record("vocabulary", self.num_items, self.raw_items)
        return retrieval_features(items, self.has_timestamps, self.max_seq_len)

    def raw_rows(self, sample_ids: Sequence[int], split: str | None) -> list[dict[str, Any]]:
        """Each user's row cut before its held-out item of `split`, raw ids as the file holds them."""
        return [
            retrieval_row(
                self.raw_users[u],
                [self.raw_items[i] for i in self.sequences[u]],
                self.timestamps[u],
                split,
                self.has_timestamps,
            )
            for u in map(int, sample_ids)
        ]

    def _train_part(self, user: int) -> list[int]:
        seq = self.sequences[user]
        return seq[:-2] if len(seq) >= 3 else seq

    @property
    def num_users(self) -> int:
        """The number of users (one sequence each) in the file."""
        return len(self.sequences)

    def __len__(self) -> int:
        return len(self._users)

    def __getitem__(self, index: int) -> RetrievalSample:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[RetrievalSample]:
        """The training samples `indices` (what the DataLoader fetches for a batch): their
        negatives drawn by one `unseen_items` call per epoch among them, the same as each drawn
        alone (a user's draws never depend on the others)."""
        if any(index < 0 for index in indices):
            raise IndexError(min(indices))
        epochs, local = np.divmod(np.asarray(indices, dtype=np.int64), len(self._users))
        users = np.asarray(self._users, dtype=np.int64)[local]
        kept = np.minimum(self._train_lengths[users], self.max_seq_len + 1)  # inputs and the last target
        counts = (kept - 1) * self.negatives_per_target
        negatives: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * len(indices)
        for epoch in np.unique(epochs).tolist():
            rows = np.flatnonzero(epochs == epoch)
            drawn = unseen_items(
                self.seed,
                TRAIN,
                epoch,
                users[rows],
                counts[rows],
                self._train_items,
                self._train_starts[users[rows]],
                self._train_lengths[users[rows]],
                self.num_items,
            )
            for row, part in zip(rows.tolist(), np.split(drawn, np.cumsum(counts[rows])[:-1])):
                negatives[row] = part
        samples = []
        for user, negs in zip(users.tolist(), negatives):
            train = self._train_part(user)[-(self.max_seq_len + 1) :]
            stamps = self.timestamps[user][: len(self._train_part(user))][-(self.max_seq_len + 1) :]
            samples.append(RetrievalSample(user, train[:-1], stamps[:-1], train[1:], negs, [], stamps[-1]))
        return samples

    def split(self, name: str, batch_size: int) -> _EvalSplit:
        """This rank's evaluation users of split `name` ("valid" or "test"), padded to the same
        number of `batch_size` batches on every rank."""
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        evaluated = [u for u, seq in enumerate(self.sequences) if len(seq) >= 3]
        per_rank = -(-len(evaluated) // self.world_size)
        batches = max(1, -(-per_rank // batch_size))
        return _EvalSplit(self, name, evaluated[self.rank :: self.world_size], batches * batch_size, batch_size)

    def held_out(self, user: int, split: str) -> int:
        """The dense id of `user`'s held-out item of `split`."""
        return self.sequences[user][-2 if split == "valid" else -1]

    def eval_sample(self, user: int, split: str) -> RetrievalSample:
        """One held-out evaluation sample of `user`.

        Args:
            user: the user's index.
            split: `"valid"` (the second-to-last item is the target) or `"test"` (the last).

        Returns:
            The history before the target (at most `max_seq_len` items, with timestamps) and the
            candidates: the target first, then `eval_negatives` items the user never interacted
            with (`unseen_items` in the `EVAL` domain).
        """
        seq = self.sequences[user]
        end = len(seq) - (2 if split == "valid" else 1)
        history = seq[:end][-self.max_seq_len :]
        stamps = self.timestamps[user][:end][-self.max_seq_len :]
        negatives = _unseen(self.seed, EVAL, 0, user, self.eval_negatives, seq, self.num_items)
        target_time = self.timestamps[user][end]
        return RetrievalSample(user, history, stamps, [], [], [seq[end], *negatives], target_time)


class _EvalSplit(Dataset[RetrievalSample]):
    """Evaluation samples of one split for one rank; indices past its users are padding."""

    def __init__(self, source: SequencesDataset, name: str, users: list[int], size: int, batch_size: int) -> None:
        self.source, self.name, self.users, self.size = source, name, users, size
        catalog = source.num_items if source.full_eval else 0
        self.collate = raw_item_collate(partial(collate_retrieval, catalog_size=catalog), source.catalogue)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> RetrievalSample:
        if index < len(self.users):
            return self.source.eval_sample(self.users[index], self.name)
        sample = self.source.eval_sample(self.users[0], self.name) if self.users else None
        if sample is None:  # a rank without evaluated users still joins every collective
            return RetrievalSample(-1, [0], [0], [], [], list(range(self.source.eval_negatives + 1)))
        sample.sample_id = -1
        return sample


def _check_negatives_exist(data: Interactions, sequences: list[list[int]], num_items: int) -> None:
    """Every user that is trained or evaluated (two interactions or more) needs items it never
    interacted with to sample negatives from; checked for every user of the file (not only this
    rank's) when the data is read, so `--check` finds it before anything starts."""
    for user, seq in enumerate(sequences):
        if len(seq) >= max(2, num_items) and len(set(seq)) >= num_items:
            raise ConfigError(
                ConfigProblem(
                    "data.path",
                    f"{data.source}: user {data.users[user]} interacted with all {num_items} items, so no negatives "
                    "can be sampled for it; remove the user's lines or add items",
                )
            )


def _unseen(
    seed: int, domain: int, epoch: int, user: int, count: int, seen: Sequence[int], num_items: int
) -> list[int]:
    """One user's `count` negatives (`recsys_pipe.data.negatives.unseen_items`, what it draws for
    the same user inside any batch)."""
    items = np.asarray(seen, dtype=np.int64)
    return unseen_items(seed, domain, epoch, [user], [count], items, [0], [len(items)], num_items).tolist()
