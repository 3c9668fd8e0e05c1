"""`recsys-data`: the data tools, one subcommand each.

    recsys-data convert criteo SRC... DST      Criteo TSV -> Parquet (what data=parquet reads)
    recsys-data convert sequences SRC DST      "user item" / MovieLens ratings -> sequence Parquet

Argparse, not Hydra: these are file tools with positional paths, not training runs. The logic
lives in `recsys_pipe.data` (`convert.py`); this module parses the command line and turns bad input
into one `recsys-data: error: ...` line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from recsys_pipe.config import ConfigError, ConfigProblem

__all__ = ["main", "parser", "run"]

EXIT_BAD_INPUT = 2


def parser() -> argparse.ArgumentParser:
    """The command line of `recsys-data` and its subcommands."""
    top = argparse.ArgumentParser(prog="recsys-data", description="Convert and inspect training data.")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    convert = commands.add_parser("convert", help="convert a text format to Parquet")
    formats = convert.add_subparsers(dest="format", required=True, metavar="FORMAT")

    criteo = formats.add_parser(
        "criteo",
        help="Criteo TSV (Kaggle train.txt, Terabyte day_N) -> Parquet, one file per input",
        description="Convert Criteo TSV files to Parquet (read by data=parquet): label int8, int_0..int_12 int64 "
        "(empty: 0), cat_0..cat_25 int64 (the hexadecimal id as an integer, empty: 0). One output per input, "
        "named after it; a bad row stops the conversion naming its file and line, leaving no output.",
    )
    criteo.add_argument("src", nargs="+", metavar="SRC", help="Criteo TSV files")
    criteo.add_argument("dst", metavar="DST", help="output directory (created if missing)")
    _common(criteo, 131_072)
    criteo.add_argument("--workers", type=int, default=None, help="parsing threads (default: every core)")

    seqs = formats.add_parser(
        "sequences",
        help='"user item" lines (SASRec) or MovieLens ratings -> sequence Parquet (one row per user)',
        description="Convert an interactions file to sequence Parquet (read by data=parquet_sequences): user_id, "
        "item_ids (chronological), timestamps and actions (the ratings) where the file has them.",
    )
    seqs.add_argument("src", metavar="SRC", help="ratings.dat, ratings.csv, or a 'user item' file")
    seqs.add_argument("dst", metavar="DST", help="output directory (created if missing)")
    _common(seqs, 16_384)
    seqs.add_argument("--delimiter", default=None, help="column separator (default: detected: '::', ',', tab, spaces)")
    header = seqs.add_mutually_exclusive_group()
    header.add_argument("--header", dest="header", action="store_true", default=None, help="line 1 names the columns")
    header.add_argument("--no-header", dest="header", action="store_false", help="line 1 is data")
    seqs.add_argument(
        "--columns",
        default=None,
        help="the file's columns in order, comma-separated: user, item, rating, timestamp or another name to skip "
        "(default: from the header, else user,item[,rating,timestamp])",
    )
    return top


def _common(command: argparse.ArgumentParser, row_group_size: int) -> None:
    command.add_argument(
        "--row-group-size", type=int, default=row_group_size, help=f"rows per row group (default {row_group_size})"
    )
    command.add_argument("--overwrite", action="store_true", help="replace outputs that exist")


def run(argv: Sequence[str] | None = None) -> int:
    """Run `recsys-data` with `argv` (default: the process's arguments); returns the exit code."""
    args = parser().parse_args(argv)
    try:
        if args.command == "convert":
            return _convert(args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"recsys-data: error: {problem.message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    raise AssertionError(f"unhandled command {args.command}")


def _convert(args: argparse.Namespace) -> int:
    from recsys_pipe.data.convert import convert_criteo, convert_sequences
    from recsys_pipe.data.interactions_file import CsvConfig

    if args.row_group_size < 1:
        raise ConfigError(
            ConfigProblem("--row-group-size", f"--row-group-size must be >= 1, got {args.row_group_size}")
        )
    start = time.perf_counter()
    if args.format == "criteo":
        files = convert_criteo(args.src, args.dst, args.row_group_size, args.workers, args.overwrite)
    else:
        columns = [c.strip() for c in args.columns.split(",")] if args.columns else None
        csv = CsvConfig(delimiter=args.delimiter, header=args.header, columns=columns)
        files = [convert_sequences(args.src, args.dst, args.row_group_size, args.overwrite, csv=csv)]
    seconds = time.perf_counter() - start
    rows = sum(f.rows for f in files)
    for f in files:
        print(f"{f.source} -> {f.path}: {f.rows} rows, {f.row_groups} row groups")
    print(json.dumps({"rows": rows, "seconds": round(seconds, 3), "rows_per_s": round(rows / max(seconds, 1e-9))}))
    return 0


def main() -> None:
    """Console-script entry point."""
    sys.exit(run())
