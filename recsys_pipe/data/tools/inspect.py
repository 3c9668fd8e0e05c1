"""`recsys-data inspect PATH`: what a Parquet data set holds and how ranks would share it, from
the files' footers alone (nothing is decoded).

Shows the schema, the rows, row groups and sizes of every file, and with a world size and batch
size the batches per epoch and each rank's rows (the unshuffled epoch's row sequence, as
`recsys_pipe.data.parquet.stream` shares it: rank `r` trains rows `[r * P * B, (r + 1) * P * B)`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow.parquet as pq

from recsys_pipe.data.parquet.files import ParquetFiles, open_parquet
from recsys_pipe.data.parquet.stream import EpochOrder

__all__ = ["describe"]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _short_texts(metadata: Mapping[bytes, bytes]) -> list[tuple[str, str]]:
    """The key-value entries that are short printable text (a converter's window cut), to show
    them whole; vocabularies are binary and Arrow's own schema entry is not ours."""
    out = []
    for key, value in metadata.items():
        if key.startswith(b"ARROW:") or len(value) > 200:
            continue
        try:
            text = value.decode()
        except UnicodeDecodeError:
            continue
        if text.isprintable():
            out.append((key.decode(errors="replace"), text))
    return out


def _file_sizes(files: ParquetFiles) -> list[int]:
    return [int(info.size or 0) for info in files.filesystem.get_file_info(files.paths)]


def describe(path: str | Sequence[str], world_size: int | None = None, batch_size: int | None = None) -> str:
    """The report `recsys-data inspect` prints (ConfigError, naming the file, for a bad one).

    Args:
        path: a file, directory, glob or URI, or a list of them (as `data.path`).
        world_size, batch_size: with both, also each rank's share and the batches per epoch.
    """
    files = open_parquet(path)
    sizes = _file_sizes(files)
    total_rows = files.num_rows
    groups = sum(len(g) for g in files.row_groups)
    lines = [
        f"{len(files.paths)} file(s), {total_rows} rows, {groups} row group(s), {_size(sum(sizes))} on disk "
        f"({sum(sizes) / max(total_rows, 1):.1f} bytes/row)",
        "",
        "schema:",
        *(f"  {field.name}: {field.type}" for field in files.schema),
    ]
    if files.metadata:
        keys = ", ".join(k.decode(errors="replace") for k in files.metadata if not k.startswith(b"ARROW:"))
        if keys:
            lines.append(f"key-value metadata (first file): {keys}")
        lines += [f"  {key}: {text}" for key, text in _short_texts(files.metadata)]
    lines += ["", "files:"]
    for file_path, file_groups, size in zip(files.paths, files.row_groups, sizes):
        meta = pq.ParquetFile(files.filesystem.open_input_file(file_path)).metadata
        compressed = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
        smallest, largest = min(file_groups), max(file_groups)
        lines.append(
            f"  {file_path}: {sum(file_groups)} rows in {len(file_groups)} row group(s) of {smallest}..{largest} rows, "
            f"{_size(size)} ({_size(compressed)} uncompressed)"
        )
    if world_size is None or batch_size is None:
        return "\n".join(lines)
    lines += ["", *_shares(files, world_size, batch_size)]
    return "\n".join(lines)


def _shares(files: ParquetFiles, world_size: int, batch_size: int) -> list[str]:
    global_batch = world_size * batch_size
    per_epoch = files.num_rows // global_batch
    out = [
        f"{world_size} rank(s) x batch {batch_size}: {per_epoch} batches per epoch on every rank "
        f"({per_epoch * global_batch} rows; {files.num_rows - per_epoch * global_batch} left out per epoch)"
    ]
    if per_epoch == 0:
        out.append("  too little data: fewer rows than one global batch")
        return out
    order = EpochOrder(files, 0, files.num_rows, False, 0)
    rows = per_epoch * batch_size
    for rank in range(world_size):
        slices = order.locate(0, rank * rows, (rank + 1) * rows)
        touched = sorted({(f, g) for f, g, *_ in slices})
        first_file, last_file = files.paths[touched[0][0]], files.paths[touched[-1][0]]
        span = first_file if first_file == last_file else f"{first_file} .. {last_file}"
        out.append(
            f"  rank {rank}: rows {rank * rows}..{(rank + 1) * rows - 1} of the epoch, {len(touched)} row group(s) "
            f"in {span}"
        )
    out.append("  (unshuffled order; with data.shuffle the row groups are permuted per epoch, the counts are the same)")
    return out
