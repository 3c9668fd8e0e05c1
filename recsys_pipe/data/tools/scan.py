"""`recsys-data inspect PATH --scan`: every bad row of a Parquet data set, read with all cores.

The footers show what statistics can (`--check` refuses it before a run); a row the statistics
do not show (a file written without them, a list too short, an id a vocabulary lacks) is found
only when its row group is decoded. The scan decodes every row group of the files with the
checks the training source would make (its decoder's `validate`,
`recsys_pipe.data.parquet.checks`): `recsys-data` builds the source from a training config (the
file's `layout` picks `data=parquet` or `data=parquet_sequences` and a model that reads it;
`key=value` overrides name a column mapping, a model, `data.num_candidates`, ...), with
`data.on_bad_row=skip` so that a row group's statistics do not stop it. Row groups are spread
over a process pool (one worker per core); each reports its problems check by check, with the
file, the row group, the row (of the file) and the column, up to `limit` per check and row group
(the rest counted).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

__all__ = ["ScanReport", "layout", "scan"]

#: the source the workers scan (set before the pool forks, so nothing is pickled)
_SOURCE: Any = None


@dataclass
class ScanReport:
    """What a scan found: one line per problem listed, and the counts."""

    lines: list[str]
    bad_rows: int
    rows: int
    row_groups: int
    files: int
    unlisted: int

    def text(self) -> str:
        summary = (
            f"scanned {self.rows} rows in {self.row_groups} row group(s) of {self.files} file(s): "
            f"{self.bad_rows} bad row(s)"
        )
        if self.unlisted:
            summary += f" ({self.unlisted} more problem(s) not listed)"
        return "\n".join([*self.lines, summary])


def _scan_group(unit: tuple[int, int, int], limit: int) -> tuple[list[tuple[int, str]], int, int]:
    """(problems as (row of the file, line), bad rows, unlisted) of one row group."""
    files, which, group = _SOURCE[unit[0]], unit[1], unit[2]
    decoder = _SOURCE[-1]
    table = files.read(which, group, decoder.columns)
    problems = decoder.validate(table)
    listed, unlisted = problems.listed(limit)
    first = sum(files.row_groups[which][:group])
    lines = [(first + p.row, f"{files.where(which, group, p.column, p.row)}: {p.message}") for p in listed]
    return lines, int(problems.bad.sum()), unlisted


def layout(path: str | Sequence[str]) -> list[str]:
    """`data=` and `model=` overrides that read the files' layout (sequence Parquet: windows for
    HSTU ranking, users for retrieval; else tabular rows), and sizes that never stop a scan (it
    reads every row, whatever a run would batch or sample)."""
    from recsys_pipe.data.parquet.decode import WINDOWS_KEY
    from recsys_pipe.data.parquet.files import open_parquet

    files = open_parquet(path)
    sizes = ["++data.batch_size=1"]
    if WINDOWS_KEY in files.metadata:
        return ["data=parquet_sequences", "model=hstu_small", *sizes]
    if files.schema.get_field_index("item_ids") >= 0:
        return ["data=parquet_sequences", "model=sasrec", *sizes, "++data.eval_negatives=1"]
    return ["data=parquet", "model=dlrm", *sizes]


def scan(source: Any, workers: int | None = None, limit: int = 100) -> ScanReport:
    """Every bad row of the files of `source` (a `StreamSource` built with
    `data.on_bad_row=skip`; see the module docstring)."""
    global _SOURCE
    sets = [source.files] + ([source.eval_files] if getattr(source, "eval_files", None) is not None else [])
    units = [
        (s, f, g)
        for s, files in enumerate(sets)
        for f, groups in enumerate(files.row_groups)
        for g in range(len(groups))
    ]
    _SOURCE = [*sets, source.decoder]
    workers = max(1, min(workers or os.cpu_count() or 1, len(units)))
    try:
        if workers == 1:
            results = [_scan_group(u, limit) for u in units]
        else:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                results = list(pool.map(_scan_group, units, [limit] * len(units)))
    finally:
        _SOURCE = None
    lines = [line for found, _, _ in results for _, line in found]
    return ScanReport(
        lines,
        sum(bad for _, bad, _ in results),
        sum(files.num_rows for files in sets),
        len(units),
        sum(len(files.paths) for files in sets),
        sum(left for _, _, left in results),
    )
