"""Line-aligned pieces of text files: what the file sources and the converters share.

A text source is read in chunks of whole lines, each with the number of its first line, so that
pyarrow parses a chunk at once (vectorised, on every core) and a refused row is still reported as
`<file>:<line>: <problem>`. Lines end as Python's universal newlines end them (`\\n`, `\\r\\n` or
a lone `\\r`), so the line numbers are the ones the line-by-line readers reported.

A rank's share of a file is a range of lines found by counting line ends (`count_lines`):
counting is a byte scan, not a parse, so no rank parses another rank's rows.
"""

from __future__ import annotations

import codecs
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import numpy as np

from recsys_pipe.config import ConfigError, ConfigProblem

__all__ = ["Chunk", "LineCount", "check_text_head", "fail", "line_chunks", "count_lines", "share"]

#: bytes read per scan block and per parsed chunk: large enough for pyarrow's threads to pay off,
#: small enough that a few chunks in flight stay far below the memory bound
CHUNK_BYTES = 16 << 20


def fail(path: str, line: int | None, message: str, key: str = "data.path") -> NoReturn:
    """Raise the one-line error `<path>[:<line>]: <message>` at config path `key`."""
    where = f"{path}:{line}" if line is not None else str(path)
    raise ConfigError(ConfigProblem(key, f"{where}: {message}"))


def check_text_head(path: str, layout: str) -> int:
    """Refuse an empty or binary file in one line; returns the length of a UTF-8 byte order mark at
    its start (0 without one), which is not part of the first line."""
    try:
        with open(path, "rb") as raw:
            head = raw.read(8192)
    except OSError as exc:
        fail(path, None, f"cannot read the file ({exc.strerror or exc})")
    if not head.strip():
        fail(path, None, f"the file is empty; {layout}")
    if b"\0" in head:  # a gzip/parquet/npz file: every row would be "found 1 column"
        fail(path, None, f"a binary file, not text (a compressed file must be unpacked); {layout}")
    return len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0


def _line_ends(block: bytes, next_byte: bytes) -> np.ndarray:
    """Positions just after each line end in `block` (`\\n`, or a `\\r` not followed by `\\n`;
    `next_byte` is the byte after the block, to see a `\\r\\n` split between two blocks)."""
    data = np.frombuffer(block, dtype=np.uint8)
    newline = data == 10
    if b"\r" in block:
        after = np.empty_like(newline)
        after[:-1] = newline[1:]
        after[-1:] = next_byte == b"\n"
        newline |= (data == 13) & ~after
    return np.flatnonzero(newline) + 1


def _count_ends(block: bytes, next_byte: bytes) -> int:
    if b"\r" not in block:
        return block.count(b"\n")  # the common case, at memory speed
    return len(_line_ends(block, next_byte))


@dataclass(frozen=True)
class LineCount:
    """The lines of a file (at most `max_lines` of them), counted by `count_lines`; `offset(k)`
    finds where line k starts."""

    path: str
    num_lines: int
    #: (offset, bytes, line ends) of each block scanned
    blocks: tuple[tuple[int, int, int], ...]
    #: bytes scanned (the file's size unless `max_lines` stopped the scan)
    scanned: int

    def offset(self, line: int) -> int:
        """Byte offset of the start of 0-based `line` (`num_lines`: the end of the last line).
        Rereads one block; ConfigError if the file cannot be read."""
        if not 0 <= line <= self.num_lines:
            raise ValueError(f"line {line} outside [0, {self.num_lines}]")
        ends = sum(n for _, _, n in self.blocks)
        if line == 0:
            return 0
        if line > ends:  # after a last line without a line end
            return self.scanned
        before = 0
        try:
            with open(self.path, "rb") as f:
                for start, size, n in self.blocks:
                    if before + n >= line:
                        f.seek(start)
                        block = f.read(size)
                        return start + int(_line_ends(block, f.read(1))[line - before - 1])
                    before += n
        except OSError as exc:
            fail(self.path, None, f"cannot read the file ({exc.strerror or exc})")
        raise AssertionError("unreachable: line <= line ends")


def count_lines(path: str, max_lines: int | None = None) -> LineCount:
    """Count the lines of `path` (at most `max_lines`) in one byte scan, block by block.

    A last line without a line end counts. Raises ConfigError if the file cannot be read."""
    blocks: list[tuple[int, int, int]] = []
    total = pos = 0
    last = b""
    try:
        with open(path, "rb") as f:
            block = f.read(CHUNK_BYTES)
            while block:
                following = f.read(CHUNK_BYTES)
                n = _count_ends(block, following[:1])
                blocks.append((pos, len(block), n))
                total += n
                pos += len(block)
                last = block[-1:]
                block = following
                if max_lines is not None and total >= max_lines:
                    break
    except OSError as exc:
        fail(path, None, f"cannot read the file ({exc.strerror or exc})")
    lines = total + (bool(last) and not block and last not in (b"\n", b"\r"))
    if max_lines is not None:
        lines = min(lines, max_lines)
    return LineCount(path, lines, tuple(blocks), pos)


def share(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous rows `[lo, hi)` of `num_rows`: shares differ by one row at most."""
    return num_rows * rank // world_size, num_rows * (rank + 1) // world_size


@dataclass(frozen=True)
class Chunk:
    """Whole lines of a file: `data` holds `num_lines` lines, the first of them line `first_line` (1-based)."""

    data: bytes
    first_line: int
    num_lines: int


def line_chunks(path: str, start: int, end: int, first_line: int, chunk_bytes: int | None = None) -> Iterator[Chunk]:
    """The bytes `[start, end)` of `path` (both at line starts) as chunks of whole lines, about
    `chunk_bytes` each (default `CHUNK_BYTES`)."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    line = first_line
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        carry = b""
        while left > 0 or carry:
            block = f.read(min(chunk_bytes, left)) if left > 0 else b""
            left -= len(block)
            data = carry + block
            if left > 0:
                cut = max(data.rfind(b"\n"), data.rfind(b"\r", 0, len(data) - 1))
                if cut < 0:  # a line longer than a chunk: read on
                    carry = data
                    continue
                data, carry = data[: cut + 1], data[cut + 1 :]
            else:
                carry = b""
            if not data:
                break
            n = _count_ends(data, b"")
            if data[-1:] not in (b"\n", b"\r"):
                n += 1
            yield Chunk(data, line, n)
            line += n


T = TypeVar("T")
R = TypeVar("R")


def parallel_map(fn: Callable[[T], R], items: Iterable[T], workers: int | None = None) -> Iterator[R]:
    """`map(fn, items)` on a pool of threads, in order, with at most `2 * workers` items in flight
    (bounded memory). pyarrow's parser and numpy release the GIL, so chunks parse on every core
    (`workers`: the machine's cores by default). The first error is raised in order."""
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(workers) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
