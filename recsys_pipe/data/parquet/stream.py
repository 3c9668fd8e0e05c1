"""Streaming Parquet data by position: which rows each rank trains, in which order, read in windows.

This is the machinery the Parquet sources (`data=parquet`, `data=parquet_sequences`) share; a
source supplies only how a decoded table becomes rows of its batches (a `Decoder`).

**The order of an epoch.** The training rows of an epoch are the row groups of the files (with
any held-out tail cut off), concatenated in an order permuted with `(data.seed, epoch)` (file
order without `data.shuffle`). Call that the epoch's row sequence. Rank `r` of `W` trains the
rows `[r * P * B, (r + 1) * P * B)` of it (`P` batches per epoch, `B = data.batch_size`): a row
range known from the row groups' row counts alone, so every rank has exactly `P` batches, even
with more ranks than files or row groups, and no rank reads another's rows.

**The shuffle window.** A rank's rows are cut into consecutive windows of `data.shuffle_window`
rows (rounded down to a multiple of `B`, at least `B`); the rows of a window are permuted with a
generator seeded by `(data.seed, epoch, window start)`. A row therefore moves at most one window
from its row group's place: the window bounds memory and start-up time; a full shuffle would
need every row group of the epoch before the first batch.

**Position.** Batch `p` of a run is batch `p % P` of epoch `p // P`; its window and its offset in
the window follow from the metadata, so a run resumed at `p` starts decoding at that window and
drops the rows before the offset: nothing is replayed. The number of batches trained is the
whole data state (as for the map-style sources, `recsys_pipe.data.source`).

**Workers.** A window is one item of a map-style dataset (`WindowDataset`): one DataLoader worker
decodes it whole, into rows that are tensors (`Rows`), and the main process cuts the windows'
rows into batches. Decoding is vectorised Arrow -> numpy -> torch; nothing loops over rows.
A worker that meets a bad row group hands back the error as data; the main process raises it.

**The hand-off** (`BlockDecoder`s: `data=parquet`'s, `data=parquet_sequences`' for retrieval). A
piece's rows cross from a worker to the main process in one block of shared memory that the
main process allocated before the workers started (`_Ring`: `prefetch_factor + 1` blocks per
worker, reused piece after piece, each `StreamSource.piece_rows * row_bytes`).
The worker decodes into the block and hands back only the block's number and where each tensor
lies in it; the main process gathers its batches out of the block (copies in memory of its own)
and then releases it. Fresh shared memory per window (torch's way of passing a worker's tensors)
costs a page fault per 4 KiB page on both sides, every window: on the 2-core benchmark machine
that was about a quarter of a worker's time (24 of 93 ms per window of 65,536 Criteo rows). A
worker whose blocks are all still in use (it cannot be, with the DataLoader's prefetching
bounded as it is, but nothing relies on that) decodes into fresh shared memory instead.

**Bad rows** (`data.on_bad_row`). By default a row the decoder refuses stops the run with one
line naming the file, the row and the column. With `skip`, a window's bad rows are found first
(the decoder's `validate`, `recsys_pipe.data.parquet.checks`) and left out of its decoding, but
they keep their positions: batch `p` is still the rows of its positions, less its bad ones, so no
other batch changes and a resume stays exact (a batch with bad rows is smaller; one with no good
row stops the run). `BatchStream.skipped` counts each batch's skipped rows, in order.

**A change of world size** (`resume_layout`): with the global batch size `W * B` kept, the
epoch has the same `P` batches, and the rest of the interrupted epoch is what the old ranks had
not trained yet, concatenated in old-rank order and cut into `W'` equal parts: every row of the
epoch is trained exactly once across the two runs. The layouts an epoch was trained under are
part of the checkpoint (`Layout`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.data.parquet.files import DataFileError, ParquetFiles, read_rows
from recsys_pipe.data.source import PositionalSource

__all__ = [
    "Alloc",
    "BatchStream",
    "BlockDecoder",
    "Decoder",
    "Fail",
    "EpochOrder",
    "Layout",
    "Piece",
    "ReusedArrays",
    "Rows",
    "StreamSource",
    "WindowDataset",
    "rank_pieces",
    "shared_empty",
]

_U64 = 2**64


class Rows(Protocol):
    """Decoded rows of a source (tensors), cut and joined by the main process into batches."""

    def __len__(self) -> int: ...

    def slice(self, start: int, stop: int) -> Rows:
        """Rows `[start, stop)`."""

    @classmethod
    def concat(cls, parts: Sequence[Rows]) -> Rows:
        """The rows of `parts`, in order."""

    def batch(self) -> Any:
        """These rows as one training batch."""


# A source's decoded rows may also have `finish(epoch) -> Rows`: what the window's rows become in
# that epoch (e.g. negatives drawn afresh), called by the worker after the window is cut.


Fail = Callable[..., DataFileError]
"""`fail(column, message, row=0)`: the `DataFileError` naming the file, row group (the one of the
window's row `row`, before any permutation) and column being decoded."""


class Decoder(Protocol):
    """A source's part: its columns and how one row group's table becomes `Rows`."""

    columns: Sequence[str]

    def __call__(self, table: pa.Table, sample_ids: np.ndarray, order: np.ndarray | None, fail: Fail) -> Rows:
        """Decode `table` (its rows' global positions `sample_ids`) into rows in the order `order`
        (indices into the table; None: as they are); `fail(column, message, row)` is the error to
        raise for a bad value."""


Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""`alloc(shape, dtype)`: an uninitialised tensor for decoded rows (in the window's shared block
inside a worker, `shared_empty` otherwise)."""


@runtime_checkable
class BlockDecoder(Decoder, Protocol):
    """A decoder whose rows can live in one shared block (module docstring, "The hand-off"): it
    allocates every tensor of its rows with `alloc`, needs at most `row_bytes` bytes per row of
    the table, and its rows' `batch()` and `copy()` return tensors of their own, never views of
    the rows' (the block is reused once they are made)."""

    row_bytes: int

    def __call__(  # type: ignore[override]  # a Decoder that also takes `alloc`
        self, table: pa.Table, sample_ids: np.ndarray, order: np.ndarray | None, fail: Fail, alloc: Alloc
    ) -> Rows: ...


@dataclass(frozen=True)
class Piece:
    """Rows of one window: rows `[start, start + length)` of epoch `epoch`'s row sequence,
    permuted (with `data.shuffle`), of which `[skip, skip + take)` are used."""

    epoch: int
    start: int
    length: int
    skip: int
    take: int


@dataclass(frozen=True)
class Layout:
    """The data-parallel layout a stretch of an epoch was trained under: `world` ranks of
    `batch` rows each, from batch `since` of the epoch on."""

    world: int
    batch: int
    since: int = 0


class EpochOrder:
    """Where the rows of each epoch's row sequence are: row groups (or the used part of them)
    permuted per `(seed, epoch)`.

    Args:
        files: the data set.
        first, stop: the global row range the sequence is drawn from (training: all but the
            held-out tail; evaluation: the tail, or the evaluation files).
        shuffle: permute the row groups (and windows) per epoch.
        seed: `data.seed`.
    """

    def __init__(self, files: ParquetFiles, first: int, stop: int, shuffle: bool, seed: int) -> None:
        units = files.units()
        rows = files.unit_rows()
        lo = np.clip(first - units[:, 2], 0, rows)
        hi = np.clip(stop - units[:, 2], 0, rows)
        keep = hi > lo
        #: per used row group: file, row group, first used row in it, rows used, global first row
        self.units = np.stack(
            [units[keep, 0], units[keep, 1], lo[keep], hi[keep] - lo[keep], units[keep, 2] + lo[keep]], 1
        )
        self.num_rows = int(self.units[:, 3].sum()) if len(self.units) else 0
        self.shuffle, self.seed = shuffle, seed
        self._cached: tuple[int, np.ndarray, np.ndarray] | None = None
        self._permuted: tuple[tuple[int, int, int], np.ndarray] | None = None

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1], self._cached[2]
        n = len(self.units)
        if self.shuffle:
            order = np.random.default_rng([self.seed % _U64, epoch, 0x5EED]).permutation(n)
        else:
            order = np.arange(n)
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.units[order, 3], out=starts[1:])
        self._cached = (epoch, order, starts)
        return order, starts

    def locate(self, epoch: int, start: int, stop: int) -> list[tuple[int, int, int, int, int]]:
        """Rows `[start, stop)` of the epoch's sequence as `(file, row group, lo, hi, global
        first row)` slices of row groups (`lo:hi` in the row group's own rows)."""
        order, starts = self._order(epoch)
        out = []
        i = int(np.searchsorted(starts, start, side="right")) - 1
        while start < stop:
            unit = self.units[order[i]]
            offset = start - int(starts[i])
            n = min(int(unit[3]) - offset, stop - start)
            lo = int(unit[2]) + offset
            out.append((int(unit[0]), int(unit[1]), lo, lo + n, int(unit[4]) + offset))
            start += n
            i += 1
        return out

    def permutation(self, piece: Piece) -> np.ndarray | None:
        """The order of the window's rows (None: as they are); the last window's is kept for
        its next piece (a window handed out in parts)."""
        if not self.shuffle:
            return None
        key = (piece.epoch, piece.start, piece.length)
        if self._permuted is None or self._permuted[0] != key:
            perm = np.random.default_rng([self.seed % _U64, piece.epoch, piece.start]).permutation(piece.length)
            self._permuted = (key, perm)
        return self._permuted[1]


def _windows(epoch: int, start: int, rows: int, window: int) -> list[Piece]:
    return [
        Piece(epoch, s, min(window, start + rows - s), 0, min(window, start + rows - s))
        for s in range(start, start + rows, window)
    ]


def _cut(pieces: list[Piece], start: int, stop: int) -> list[Piece]:
    """Rows `[start, stop)` of the concatenation of `pieces` (their used rows), as pieces."""
    out, pos = [], 0
    for p in pieces:
        lo, hi = max(start - pos, 0), min(stop - pos, p.take)
        if lo < hi:
            out.append(Piece(p.epoch, p.start, p.length, p.skip + lo, hi - lo))
        pos += p.take
        if pos >= stop:
            break
    return out


def rank_pieces(epoch: int, layouts: Sequence[Layout], rank: int, batches: int, window: int) -> list[Piece]:
    """The windows rank `rank` of the last layout trains in epoch `epoch`, in order, from the
    batch where that layout took over (`layouts[-1].since`).

    Args:
        layouts: the layouts the epoch was trained under, in order (the first `since` is 0);
            every one has the same global batch size.
        batches: batches per epoch (the same under every layout).
        window: `data.shuffle_window` in rows (a multiple of the first layout's batch size).
    """
    first = layouts[0]
    per_rank = batches * first.batch
    current = [_windows(epoch, r * per_rank, per_rank, window) for r in range(first.world)]
    for prev, layout in zip(layouts, layouts[1:]):
        done = (layout.since - prev.since) * prev.batch  # rows each rank of `prev` trained
        rest = [piece for pieces in current for piece in _cut(pieces, done, 10**18)]
        share = (batches - layout.since) * layout.batch
        current = [_cut(rest, r * share, (r + 1) * share) for r in range(layout.world)]
    return current[rank]


def _skip_rows(pieces: list[Piece], rows: int) -> list[Piece]:
    return _cut(pieces, rows, 10**18)


class _Failed:
    """A worker's error, handed back as data (a DataLoader would wrap and re-type it)."""

    def __init__(self, error: DataFileError) -> None:
        self.error = error


@dataclass
class _Marked:
    """A window's rows without its bad ones (None: none good), and which of its positions (in
    epoch order) they are: `kept[i]` is False for a skipped row (`data.on_bad_row=skip`)."""

    rows: Any
    kept: np.ndarray


class WindowDataset(Dataset):
    """Map-style: `dataset[piece]` decodes one window (a `Piece`) into `Rows`, its used rows
    in their epoch order. The window's row-group slices are joined as Arrow chunks (no copy) and
    decoded once, the permutation applied while the columns are copied out. One row group's
    table is kept for the next window of the same worker (windows smaller than row groups).
    With `skip`, bad rows are left out (`_Marked`)."""

    def __init__(self, files: ParquetFiles, order: EpochOrder, decoder: Decoder, skip: bool = False) -> None:
        self.files, self.order, self.decoder, self.skip = files, order, decoder, skip
        self._last: tuple[tuple[int, int], pa.Table] | None = None

    def __len__(self) -> int:  # indexed by pieces, not by integers
        raise TypeError("a WindowDataset is indexed by Piece")

    def _group(self, file: int, group: int) -> pa.Table:
        if self._last is None or self._last[0] != (file, group):
            self._last = ((file, group), self.files.read(file, group, self.decoder.columns))
        return self._last[1]

    def __getitem__(self, piece: Piece) -> Rows | _Failed:
        return self.decode(piece, shared_empty)

    def decode(self, piece: Piece, alloc: Alloc) -> Rows | _Failed:
        """The window's rows; a `BlockDecoder` allocates them with `alloc`."""
        perm = self.order.permutation(piece)
        if perm is None:  # only the used rows
            start, stop, order = piece.start + piece.skip, piece.start + piece.skip + piece.take, None
        else:
            start, stop, order = piece.start, piece.start + piece.length, perm[piece.skip : piece.skip + piece.take]
        slices = self.order.locate(piece.epoch, start, stop)
        files = self.files
        bounds = np.cumsum([0] + [hi - lo for _, _, lo, hi, _ in slices])

        def fail(column: str, message: str, row: int | None = None) -> DataFileError:
            at = int(np.searchsorted(bounds, row or 0, side="right")) - 1
            f, g, lo, *_ = slices[at]
            within = None if row is None else lo + row - int(bounds[at])
            return DataFileError(files.key, files.where(f, g, column, within), message)

        try:
            tables = [self._group(f, g).slice(lo, hi - lo) for f, g, lo, hi, _ in slices]
            table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
            ids = np.concatenate([np.arange(first, first + hi - lo, dtype=np.int64) for _, _, lo, hi, first in slices])
            if not self.skip:
                return self._decode(table, ids, order, fail, alloc, piece.epoch)
            return self._decode_good(table, ids, order, fail, alloc, piece.epoch)
        except DataFileError as exc:
            return _Failed(exc)

    def _decode(self, table: pa.Table, ids: np.ndarray, order: Any, fail: Fail, alloc: Alloc, epoch: int) -> Rows:
        if isinstance(self.decoder, BlockDecoder):
            rows = self.decoder(table, ids, order, fail, alloc)
        else:
            rows = self.decoder(table, ids, order, fail)
        finish = getattr(rows, "finish", None)  # rows that depend on the epoch (negatives drawn per epoch)
        return finish(epoch) if finish is not None else rows

    def _decode_good(
        self, table: pa.Table, ids: np.ndarray, order: Any, fail: Fail, alloc: Alloc, epoch: int
    ) -> Rows | _Marked:
        """The window less its bad rows (`validate`), which keep their positions (`_Marked`)."""
        bad = self.decoder.validate(table).bad  # type: ignore[attr-defined]
        if not bad.any():
            return self._decode(table, ids, order, fail, alloc, epoch)
        good = ~bad
        kept = good if order is None else good[order]
        if not kept.any():
            return _Marked(None, kept)
        place = np.cumsum(good) - 1  # each good row's place in the table without the bad ones
        at = np.flatnonzero(good)

        def fail_good(column: str, message: str, row: int | None = None) -> DataFileError:
            return fail(column, message, None if row is None else int(at[row]))

        good_order = None if order is None else place[order[kept]]
        rows = self._decode(table.filter(pa.array(good)), ids[good], good_order, fail_good, alloc, epoch)
        return _Marked(rows, kept)


class ReusedArrays:
    """Scratch arrays by name, reused window after window: a decoder's large temporaries come
    without page faults and without heap growth (`reused(name, n, dtype)`: an uninitialised
    array of `n` elements, the one the previous call of that name and dtype returned, grown if
    needed). What it returned before is overwritten: a decoder hands out nothing that points
    into one once it decodes the next window."""

    def __init__(self) -> None:
        self._arrays: dict[tuple[str, np.dtype], np.ndarray] = {}

    def __call__(self, name: str, n: int, dtype: Any) -> np.ndarray:
        key = (name, np.dtype(dtype))
        array = self._arrays.get(key)
        if array is None or array.size < n:
            array = self._arrays[key] = np.empty(n, dtype=dtype)
        return array[:n]


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor, allocated in shared memory inside a DataLoader worker: handing it
    to the main process then moves no bytes (a worker's tensors are otherwise copied into shared
    memory on the way). Allocated there directly, as torch's `default_collate` allocates a
    worker's batch (`share_memory_()` on a new tensor would copy its garbage in)."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    numel = 1
    for n in shape:
        numel *= n
    storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(numel)
    return torch.empty(0, dtype=dtype).set_(storage._untyped_storage, 0, shape)


def _identity(item: Any) -> Any:
    return item


#: glibc's `mallopt` parameter of the size from which `malloc` maps memory of its own
_M_MMAP_THRESHOLD = -3


def _init_worker(worker_id: int) -> None:
    """Fix glibc's mmap threshold in a decoding worker (at 128 KiB, its default start).

    A window's columns are megabyte-sized numpy arrays, allocated and freed once per window. By
    default glibc raises the threshold to the largest block freed so far, after which such
    arrays come from the heap, which fragments: a worker's resident memory then grows with the
    number of windows decoded (measured: 560 to 1060 MiB over 8M rows, flat at 430 MiB with the
    threshold fixed). Other C libraries: nothing to do."""
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    except (OSError, AttributeError):
        pass


#: windows a DataLoader worker decodes ahead (the DataLoader's `prefetch_factor`)
_PREFETCH = 2
#: shared blocks per worker: its windows in flight, and the one the main process is cutting
_RING_DEPTH = _PREFETCH + 1
_ALIGN = 64


def _shared_bytes(nbytes: int) -> torch.Tensor:
    """A `[nbytes]` uint8 tensor in shared memory, uninitialised (see `shared_empty`)."""
    storage = torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage._untyped_storage, 0, (nbytes,))


class _BlockAlloc:
    """`Alloc` that carves tensors out of one block (64-byte aligned), or allocates them in fresh
    shared memory once the block is full (a window larger than the block was sized for)."""

    def __init__(self, block: torch.Tensor | None) -> None:
        self.block, self.used = block, 0

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * dtype.itemsize
        if self.block is None or self.used + nbytes > self.block.numel():
            return shared_empty(shape, dtype)
        out = torch.empty(0, dtype=dtype).set_(self.block.untyped_storage(), self.used // dtype.itemsize, shape)
        self.used += -(-nbytes // _ALIGN) * _ALIGN
        return out


@dataclass(frozen=True)
class _Ref:
    """Where a tensor lies in a block: byte offset, shape, strides (elements), dtype."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """`obj` with `fn` applied to each tensor or `_Ref` in it (through dataclasses, lists, tuples)."""
    if isinstance(obj, (torch.Tensor, _Ref)):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: _map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        )
    return obj


@dataclass
class _Staged:
    """Rows a worker decoded into block `index`, their tensors there replaced by `_Ref`s."""

    index: int
    rows: Any


class _Ring:
    """The shared blocks of one iteration over the windows (module docstring, "The hand-off"):
    `depth` blocks per worker, allocated by the main process before the workers start. Worker
    `w` fills its blocks in turn and may reuse one once the main process has released as many
    of its blocks as it has filled minus `depth` (counted in shared memory under a lock, which
    orders the main process's reads of a block before the worker's next writes)."""

    def __init__(self, workers: int, depth: int, block_bytes: int) -> None:
        self.depth = depth
        self.blocks = [_shared_bytes(block_bytes) for _ in range(workers * depth)]
        self.released = multiprocessing.get_context().Array("q", workers)
        self.filled = 0  # in a worker: the blocks it has filled (each worker has its own copy)

    def take(self) -> tuple[int | None, _BlockAlloc]:
        """In a worker: the next free block of its own and an allocator over it (None and fresh
        shared memory if all its blocks are still in use)."""
        worker = get_worker_info().id
        with self.released.get_lock():
            released = self.released[worker]
        if self.filled - released >= self.depth:
            return None, _BlockAlloc(None)
        index = worker * self.depth + self.filled % self.depth
        self.filled += 1
        return index, _BlockAlloc(self.blocks[index])

    def untake(self) -> None:
        """In a worker: its last block was not handed over (the window failed to decode)."""
        self.filled -= 1

    def stage(self, index: int, rows: Any) -> _Staged:
        """In a worker: `rows` with the tensors in block `index` replaced by where they lie."""
        block = self.blocks[index]
        base, ptr = block.data_ptr(), block.untyped_storage().data_ptr()

        def ref(t: Any) -> Any:
            if t.untyped_storage().data_ptr() != ptr:
                return t  # fresh shared memory: pickled by torch
            return _Ref(t.data_ptr() - base, tuple(t.shape), tuple(t.stride()), t.dtype)

        return _Staged(index, _map_tensors(rows, ref))

    def unstage(self, staged: _Staged) -> Any:
        """In the main process: the rows, their tensors views of the block."""
        storage = self.blocks[staged.index].untyped_storage()

        def view(r: Any) -> Any:
            if not isinstance(r, _Ref):
                return r
            return torch.empty(0, dtype=r.dtype).set_(storage, r.offset // r.dtype.itemsize, r.shape, r.stride)

        return _map_tensors(staged.rows, view)

    def release(self, index: int) -> None:
        """In the main process: block `index` is read; its worker may fill it again."""
        with self.released.get_lock():
            self.released[index // self.depth] += 1


class _RingWindows(Dataset):
    """The windows of a `WindowDataset` decoded into the blocks of `ring` (in the workers)."""

    def __init__(self, windows: WindowDataset, ring: _Ring) -> None:
        self.windows, self.ring = windows, ring

    def __getitem__(self, piece: Piece) -> Any:
        index, alloc = self.ring.take()
        rows = self.windows.decode(piece, alloc)
        if index is None:
            return rows
        if isinstance(rows, _Failed):
            self.ring.untake()
            return rows
        return self.ring.stage(index, rows)


class _Cutter:
    """Cuts the rows of consecutive windows into batches of `batch_size` rows, in order."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.pending: list[Rows] = []
        self.held = 0

    def add(self, rows: Rows) -> list[Any]:
        """The batches complete once `rows` (the next window's) are added."""
        self.pending.append(rows)
        self.held += len(rows)
        if self.held < self.batch_size:
            return []
        joined = self.pending[0] if len(self.pending) == 1 else type(self.pending[0]).concat(self.pending)
        full = self.held // self.batch_size * self.batch_size
        batches = [joined.slice(s, s + self.batch_size).batch() for s in range(0, full, self.batch_size)]
        self.pending = [joined.slice(full, self.held)] if full < self.held else []
        self.held -= full
        return batches

    def own(self) -> None:
        """Copy the rows held back into memory of their own (their block is about to be reused)."""
        self.pending = [p.copy() for p in self.pending]


class _SkippingCutter(_Cutter):
    """`_Cutter` by positions: a batch is the good rows of its `batch_size` positions (`_Marked`
    windows), and `skipped` gets the count of its bad ones."""

    def __init__(self, batch_size: int, skipped: deque[int]) -> None:
        super().__init__(batch_size)
        self.skipped = skipped
        self.kept: list[np.ndarray] = []
        self.positions = 0

    def add(self, rows: Rows | _Marked) -> list[Any]:
        kept = rows.kept if isinstance(rows, _Marked) else np.ones(len(rows), dtype=bool)
        rows = rows.rows if isinstance(rows, _Marked) else rows
        if rows is not None:
            self.pending.append(rows)
        self.kept.append(kept)
        self.positions += len(kept)
        if self.positions < self.batch_size:
            return []
        joined = None
        if self.pending:
            joined = self.pending[0] if len(self.pending) == 1 else type(self.pending[0]).concat(self.pending)
        kept_all = np.concatenate(self.kept)
        full = self.positions // self.batch_size * self.batch_size
        batches, at = [], 0
        for start in range(0, full, self.batch_size):
            good = int(kept_all[start : start + self.batch_size].sum())
            if not good or joined is None:
                raise ConfigError(
                    ConfigProblem(
                        "data.on_bad_row",
                        f"every row of a batch of {self.batch_size} was bad and skipped: nothing to train on",
                    )
                )
            batches.append(joined.slice(at, at + good).batch())
            self.skipped.append(self.batch_size - good)
            at += good
        left = 0 if joined is None else len(joined) - at
        self.pending = [joined.slice(at, at + left)] if left and joined is not None else []
        self.kept = [kept_all[full:]]
        self.positions -= full
        return batches


class BatchStream:
    """The batches of a sequence of pieces: windows decoded by `num_workers` DataLoader workers
    (or in this process), cut into batches of `batch_size` rows in order, pinned with `pin_memory`
    (on CUDA).

    Args:
        window: the most rows a piece has (`data.shuffle_window`, rounded): it sizes the blocks
            a `BlockDecoder`'s windows are handed over in.
    """

    def __init__(
        self,
        dataset: WindowDataset,
        pieces: Callable[[], Iterator[Piece]],
        batch_size: int,
        num_workers: int,
        pin_memory: bool,
        window: int,
    ) -> None:
        self.dataset, self.pieces = dataset, pieces
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        self.window = window
        #: how the windows of the last iteration crossed from the workers: in a reused shared
        #: block ("block") or in fresh shared memory ("fresh")
        self.handoffs: Counter[str] = Counter()
        #: with `data.on_bad_row=skip`: the rows skipped in each batch made so far, in order (the
        #: trainer takes one as it trains each batch)
        self.skipped: deque[int] = deque()

    def __iter__(self) -> Iterator[Any]:
        ring = None
        dataset: Dataset = self.dataset
        decoder = self.dataset.decoder
        self.handoffs = Counter()
        if self.num_workers and isinstance(decoder, BlockDecoder):
            block_bytes = self.window * decoder.row_bytes + 16 * _ALIGN  # each tensor's alignment
            ring = _Ring(self.num_workers, _RING_DEPTH, block_bytes)
            dataset = _RingWindows(self.dataset, ring)
        loader = DataLoader(
            dataset,
            batch_size=None,
            sampler=_Pieces(self.pieces),
            num_workers=self.num_workers,
            prefetch_factor=_PREFETCH if self.num_workers else None,
            collate_fn=_identity,
            worker_init_fn=_init_worker,
            # its own generator: creating an iterator must not draw from the global torch RNG
            generator=torch.Generator().manual_seed(0),
        )
        cutter = _SkippingCutter(self.batch_size, self.skipped) if self.dataset.skip else _Cutter(self.batch_size)
        pin = self.pin_memory and torch.cuda.is_available()
        for rows in loader:
            index = None
            if isinstance(rows, _Staged):
                index, rows = rows.index, ring.unstage(rows)
            if isinstance(rows, _Failed):
                raise rows.error
            if self.num_workers:
                self.handoffs["fresh" if index is None else "block"] += 1
            batches = cutter.add(rows)
            if index is not None:  # nothing may point into the block once it is released
                cutter.own()
                ring.release(index)
            for batch in batches:
                yield batch.pin_memory() if pin else batch


class _Pieces:
    """A sampler that is a re-iterable over pieces (DataLoader samplers may yield any index)."""

    def __init__(self, make: Callable[[], Iterator[Piece]]) -> None:
        self.make = make

    def __iter__(self) -> Iterator[Piece]:
        return self.make()


class StreamSource(PositionalSource):
    """One rank's share of a Parquet data set, by position (see the module docstring): what
    `RankData` delegates to for a streaming source (`prepare`, then the loaders).

    Args:
        files: the training files.
        decoder: turns a row group's table into rows.
        rank, world_size: this rank of the data-parallel ranks.
        cfg: the data section (`batch_size`, `num_batches`, `shuffle`, `seed`, `shuffle_window`,
            `num_workers`, `pin_memory`).
        spec: the model-sizing spec.
        eval_files: `data.eval_path`'s files, if named.
        max_rows: use only the first rows of the files (`data.max_rows`).
    """

    def __init__(
        self,
        files: ParquetFiles,
        decoder: Decoder,
        rank: int,
        world_size: int,
        cfg: Any,
        spec: Any,
        eval_files: ParquetFiles | None = None,
        max_rows: int | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.files, self.decoder, self.rank, self.world_size = files, decoder, rank, world_size
        self.cfg, self.spec, self.eval_files = cfg, spec, eval_files
        self.total = min(files.num_rows, max_rows) if max_rows is not None else files.num_rows
        self.batch_size = cfg.batch_size
        self.window = max(cfg.batch_size, cfg.shuffle_window // cfg.batch_size * cfg.batch_size)
        #: the layouts the current epoch was trained under before this run (`resume_layout`)
        self.resumed: tuple[int, list[Layout]] | None = None
        self.prepare(0)

    def prepare(self, eval_batches: int) -> None:
        """Split the rows into training and `eval_batches` held-out batches per rank (the tail of
        the files, or the start of `data.eval_path`); ConfigError naming the keys if they do not fit."""
        cfg, files, world_size = self.cfg, self.files, self.world_size
        batch_size = cfg.batch_size
        global_batch = world_size * batch_size
        total = self.total
        held_out = 0
        eval_files = self.eval_files
        if eval_files is not None:
            self.eval_batches = eval_batches or eval_files.num_rows // global_batch
            if self.eval_batches * global_batch > eval_files.num_rows:
                raise ConfigError(
                    ConfigProblem(
                        "trainer.eval_batches",
                        f"{eval_batches} batches x data.batch_size={batch_size} x {world_size} rank(s) need "
                        f"{eval_batches * global_batch} rows, but data.eval_path has {eval_files.num_rows}",
                    )
                )
            self.eval_order = EpochOrder(eval_files, 0, eval_files.num_rows, False, cfg.seed)
            eval_source = eval_files
        else:
            self.eval_batches = eval_batches
            held_out = eval_batches * global_batch
            self.eval_order = EpochOrder(files, max(total - held_out, 0), total, False, cfg.seed)
            eval_source = files
        available = (total - held_out) // global_batch if total > held_out else 0
        if cfg.num_batches is not None and cfg.num_batches > available:
            raise ConfigError(
                ConfigProblem(
                    "data.num_batches",
                    f"{cfg.num_batches} batches x data.batch_size={batch_size} x {world_size} rank(s) need "
                    f"{cfg.num_batches * global_batch} rows, but {files.key} has {max(total - held_out, 0)} "
                    "training rows",
                )
            )
        self.batches_per_epoch = cfg.num_batches or available
        if self.batches_per_epoch < 1:
            raise ConfigError(
                ConfigProblem(
                    files.key,
                    f"too little data: {total} rows, fewer than one global batch ({world_size} rank(s) x "
                    f"data.batch_size={batch_size}) plus trainer.eval_batches={eval_batches} held-out batches "
                    f"({global_batch + held_out} rows); lower data.batch_size or trainer.eval_batches, or use fewer "
                    "ranks",
                )
            )
        self.order = EpochOrder(files, 0, total - held_out, cfg.shuffle, cfg.seed)
        skip = cfg.on_bad_row == "skip"
        self.train_windows = WindowDataset(files, self.order, self.decoder, skip)
        self.eval_windows = WindowDataset(eval_source, self.eval_order, self.decoder, skip)

    def serving_features(self) -> dict[str, Any]:
        """How the decoder transforms each feature (`recsys_pipe.data.serving.ServedSource`)."""
        return self.decoder.serving_features()  # type: ignore[attr-defined]

    def raw_rows(self, sample_ids: Sequence[int], split: str | None) -> list[dict[str, Any]]:
        """The rows at the global positions `sample_ids` (of `data.eval_path`'s files for the
        split `eval` when it names some), the columns the decoder reads, as the files hold them."""
        files = self.eval_files if split == "eval" and self.eval_files is not None else self.files
        rows = read_rows(files, sample_ids, self.decoder.columns)  # type: ignore[attr-defined]
        named = getattr(self.decoder, "named_row", None)  # numbered text ids back to their texts
        return rows if named is None else [named(row) for row in rows]

    @property
    def piece_rows(self) -> int:
        """The most rows a training piece has (`epoch_pieces`): it sizes the blocks a
        `BlockDecoder`'s rows cross from the workers in (`BatchStream`)."""
        return self.window

    @property
    def layout(self) -> Layout:
        """This run's layout (its world size and batch size)."""
        return Layout(self.world_size, self.batch_size)

    def epoch_pieces(self, epoch: int) -> list[Piece]:
        """This rank's windows of `epoch`, from where this run's layout took over in it."""
        layouts = [self.layout]
        if self.resumed is not None and self.resumed[0] == epoch:
            layouts = self.resumed[1]
        pieces = rank_pieces(epoch, layouts, self.rank, self.batches_per_epoch, self.window)
        return pieces

    def train_loader(self, epochs: int = 1, start: int = 0) -> BatchStream:
        """Batches of `epochs` epochs from batch position `start` (over all epochs)."""
        per_epoch = self.batches_per_epoch

        def pieces() -> Iterator[Piece]:
            first, batch = divmod(start, per_epoch)
            for epoch in range(first, epochs):
                these = self.epoch_pieces(epoch)
                if epoch == first:
                    since = self.resumed[1][-1].since if self.resumed and self.resumed[0] == epoch else 0
                    these = _skip_rows(these, (batch - since) * self.batch_size)
                yield from these

        cfg = self.cfg
        return BatchStream(
            self.train_windows, pieces, self.batch_size, cfg.num_workers, cfg.pin_memory, self.piece_rows
        )

    def eval_loader(self) -> BatchStream | None:
        """The held-out batches of this rank (the same every evaluation), or None without any."""
        if not self.eval_batches:
            return None
        rows = self.eval_batches * self.batch_size

        def pieces() -> Iterator[Piece]:
            yield from _windows(0, self.rank * rows, rows, self.window)

        cfg = self.cfg
        return BatchStream(self.eval_windows, pieces, self.batch_size, cfg.num_workers, cfg.pin_memory, self.window)

    def resume_layout(self, position: int, layouts: Sequence[tuple[int, ...]]) -> int:
        """Continue from `position` (batches trained) of a run whose current epoch was trained
        under `layouts` (its last one is the run's own); returns the position to start from.

        The same layout: nothing changes. Another world size with the same global batch size:
        the rest of the epoch is the rows the old ranks had not trained (module docstring). A
        different global batch size is refused in one line (the epoch would not split exactly).
        """
        layouts = [Layout(*layout) for layout in layouts]
        old = layouts[-1]
        if old.world == self.world_size and old.batch == self.batch_size:
            self.resumed = (position // self.batches_per_epoch, list(layouts))
            return position
        if old.world * old.batch != self.world_size * self.batch_size:
            global_batch = old.world * old.batch
            hint = (
                f"set data.batch_size={global_batch // self.world_size}"
                if global_batch % self.world_size == 0
                else f"use a number of ranks that divides {global_batch}"
            )
            raise ConfigError(
                ConfigProblem(
                    "data.batch_size",
                    f"the checkpoint trained {old.world} rank(s) x data.batch_size={old.batch} = {global_batch} rows "
                    f"per step, this run {self.world_size} x {self.batch_size}: keep the global batch size to resume "
                    f"exactly ({hint})",
                )
            )
        epoch, batch = divmod(position, self.batches_per_epoch)
        history = list(layouts) if batch else []
        self.resumed = (epoch, [*history, Layout(self.world_size, self.batch_size, batch)])
        return position

    def layout_state(self, position: int) -> list[list[int]]:
        """The layouts of the epoch at `position` (for a checkpoint): `[[world, batch, since], ...]`."""
        epoch = position // self.batches_per_epoch
        if self.resumed is not None and self.resumed[0] == epoch:
            return [[lay.world, lay.batch, lay.since] for lay in self.resumed[1]]
        return [[self.world_size, self.batch_size, 0]]
