"""`recsys-data`: data set tools, one subcommand each (argparse, not Hydra: these are file tools
with positional paths, not training runs; the work lives in `recsys_pipe.data`).

- `recsys-data convert criteo SRC... DST`: Criteo TSV files (Kaggle `train.txt`, Terabyte
  `day_N`) to Parquet, one file per input, what `data=parquet` reads (`recsys_pipe.data.tools.convert`).
- `recsys-data convert sequences SRC DST`: a "user item" file (SASRec) or MovieLens ratings to
  sequence Parquet, one row per user, what `data=parquet_sequences` reads; with `--windows L`,
  one row per window of ratings, what it reads for HSTU ranking.
- `recsys-data inspect PATH [--world-size N --batch-size B] [--scan [key=value ...]]`: a
  Parquet data set's schema, rows, row groups and sizes, and each rank's share and the batches per
  epoch (`recsys_pipe.data.tools.inspect.describe`); with `--scan`, every bad row, read with all
  cores (`recsys_pipe.data.tools.scan`).

A bad input exits 2 with one line `error: <what>: <message>`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from recsys_pipe.config import ConfigError, ConfigProblem

__all__ = ["main"]

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def _inspect(args: argparse.Namespace) -> int:
    from recsys_pipe.data.tools.inspect import describe

    paths = [p for p in args.path if "=" not in p]
    overrides = [p for p in args.path if "=" in p]
    if not paths:
        raise ConfigError(ConfigProblem("PATH", "names no file (key=value arguments are overrides of --scan)"))
    path = paths if len(paths) > 1 else paths[0]
    if overrides and not args.scan:
        raise ConfigError(ConfigProblem(overrides[0], "key=value overrides go with --scan"))
    print(describe(path, args.world_size, args.batch_size))
    if not args.scan:
        return EXIT_OK
    from recsys_pipe.data.tools.scan import scan

    report = scan(_scanned_source(path, overrides), args.workers)
    print(report.text())
    return EXIT_BAD_INPUT if report.bad_rows else EXIT_OK


def _scanned_source(path: str | list[str], overrides: list[str]):  # -> StreamSource
    """The training source that reads `path`, its layout from the files (`scan.layout`) and
    `overrides` (a key of the schema is added as recsys-train adds it), skipping bad rows, so that
    nothing but an unreadable config or file stops the scan (ConfigError)."""
    from omegaconf import open_dict

    from recsys_pipe.cli.compose import compose_config
    from recsys_pipe.data.tools.scan import layout
    from recsys_pipe.train.config import load_run_config

    overrides = [f"++{o.lstrip('+')}" if "." in o.split("=", 1)[0] else o for o in overrides]
    given = {o.split("=", 1)[0].lstrip("+") for o in overrides}
    chosen = [o for o in layout(path) if o.split("=", 1)[0].lstrip("+") not in given]
    paths = path if isinstance(path, str) else "[" + ",".join(path) + "]"
    cfg = compose_config(*chosen, f"data.path={paths}", "++data.on_bad_row=skip", *overrides, config_name="train")
    with open_dict(cfg):
        del cfg["hydra"]
    return load_run_config(cfg).data.dataset(0, 1)


def _convert_criteo(args: argparse.Namespace) -> int:
    from recsys_pipe.data.tools.convert import convert_criteo

    start = time.perf_counter()
    files = convert_criteo(args.src, args.dst, args.row_group_size, args.workers, args.overwrite)
    return _report(files, time.perf_counter() - start)


def _convert_sequences(args: argparse.Namespace) -> int:
    from recsys_pipe.data.text.interactions import CsvConfig
    from recsys_pipe.data.tools.convert import convert_sequences

    columns = [c.strip() for c in args.columns.split(",")] if args.columns else None
    csv = CsvConfig(delimiter=args.delimiter, header=args.header, columns=columns)
    start = time.perf_counter()
    files = [
        convert_sequences(
            args.src,
            args.dst,
            args.row_group_size,
            args.overwrite,
            csv=csv,
            windows=args.windows,
            num_candidates=args.num_candidates,
            rating_scale=args.rating_scale,
        )
    ]
    return _report(files, time.perf_counter() - start)


def _report(files: list, seconds: float) -> int:
    """One line per output, then a JSON line with the rows and the rate."""
    rows = sum(f.rows for f in files)
    for f in files:
        print(f"{f.source} -> {f.path}: {f.rows} rows, {f.row_groups} row groups")
    print(json.dumps({"rows": rows, "seconds": round(seconds, 3), "rows_per_s": round(rows / max(seconds, 1e-9))}))
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recsys-data", description="Data set tools for recsys-train.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    convert = commands.add_parser("convert", help="convert a text format to Parquet")
    formats = convert.add_subparsers(dest="format", required=True, metavar="FORMAT")
    _add_convert_criteo(formats)
    _add_convert_sequences(formats)
    _add_inspect(commands)
    return parser


def _add_convert_criteo(formats: Any) -> None:
    criteo = formats.add_parser(
        "criteo",
        help="Criteo TSV (Kaggle train.txt, Terabyte day_N) -> Parquet, one file per input",
        description="Convert Criteo TSV files to Parquet (read by data=parquet): label int8, int_0..int_12 int64 "
        "(empty: 0), cat_0..cat_25 int64 (the hexadecimal id as an integer, empty: 0). One output per input, "
        "named after it; a bad row stops the conversion naming its file and line, leaving no output.",
    )
    criteo.add_argument("src", nargs="+", metavar="SRC", help="Criteo TSV files")
    criteo.add_argument("dst", metavar="DST", help="output directory (created if missing)")
    _output_options(criteo, 131_072)
    criteo.add_argument("--workers", type=int, default=None, help="parsing threads (default: every core)")
    criteo.set_defaults(run=_convert_criteo)


def _add_convert_sequences(formats: Any) -> None:
    seqs = formats.add_parser(
        "sequences",
        help='"user item" lines (SASRec) or MovieLens ratings -> sequence Parquet (one row per user)',
        description="Convert an interactions file to sequence Parquet (read by data=parquet_sequences): user_id, "
        "item_ids (chronological), timestamps and actions (the ratings) where the file has them. Text ids (u17, "
        "B00005N7P0) are numbered in sorted order, their texts kept in the metadata.",
    )
    seqs.add_argument("src", metavar="SRC", help="ratings.dat, ratings.csv, or a 'user item' file")
    seqs.add_argument("dst", metavar="DST", help="output directory (created if missing)")
    _output_options(seqs, 16_384)
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
    seqs.add_argument(
        "--windows",
        type=int,
        default=None,
        metavar="L",
        help="HSTU ranking: one row per window of at most L ratings, cut as data=movielens cuts them with "
        "data.max_seq_len=L (default: one row per user, for next-item retrieval)",
    )
    seqs.add_argument(
        "--num-candidates",
        type=int,
        default=4,
        metavar="C",
        help="with --windows: trailing ratings of a window that are ranked (data.num_candidates; default 4)",
    )
    seqs.add_argument(
        "--rating-scale",
        type=float,
        default=5.0,
        metavar="S",
        help="ratings lie in (0, S] (default 5, MovieLens's stars); HSTU ranking reads data.thresholds in this scale",
    )
    seqs.set_defaults(run=_convert_sequences)


def _add_inspect(commands: Any) -> None:
    inspect = commands.add_parser(
        "inspect",
        help="schema, rows, row groups and sizes of Parquet files; with --world-size and --batch-size, each "
        "rank's share",
        description="Show a Parquet data set from its footers: schema, rows, row groups, sizes; with --world-size "
        "and --batch-size also the batches per epoch and each rank's rows; with --scan every bad row.",
    )
    inspect.add_argument(
        "path",
        nargs="+",
        help="file, directory, glob or URI (as data.path); with --scan also key=value overrides of the training "
        "config that reads them (a column mapping, model=..., data.num_candidates=...)",
    )
    inspect.add_argument("--world-size", type=int, metavar="N", help="ranks sharing the data")
    inspect.add_argument("--batch-size", type=int, metavar="B", help="rows per batch per rank (data.batch_size)")
    inspect.add_argument(
        "--scan",
        action="store_true",
        help="read every row (all cores) with the training source's checks and list every bad row: file, row "
        "group, row, column (exit 2 if any)",
    )
    inspect.add_argument(
        "--workers", type=int, default=None, metavar="N", help="--scan: processes (default: every core)"
    )
    inspect.set_defaults(run=_inspect)


def _output_options(command: argparse.ArgumentParser, row_group_size: int) -> None:
    command.add_argument(
        "--row-group-size", type=int, default=row_group_size, help=f"rows per row group (default {row_group_size})"
    )
    command.add_argument("--overwrite", action="store_true", help="replace outputs that exist")


def main(argv: list[str] | None = None) -> int:
    """Run `recsys-data`; returns its exit code (0 ok, 2 bad input or usage)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and (args.command != "inspect" or any("=" not in e or e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:  # `inspect PATH --scan key=value ...`: overrides after the options
        args.path += extra
    if args.command == "inspect":
        if (args.world_size is None) != (args.batch_size is None):
            parser.error("--world-size and --batch-size go together")
        for name in ("world_size", "batch_size"):
            value = getattr(args, name)
            if value is not None and value < 1:
                parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.command == "convert" and args.row_group_size < 1:
        parser.error("--row-group-size must be >= 1")
    if getattr(args, "windows", None) is not None and args.windows < 2:
        parser.error("--windows must be >= 2")
    try:
        return args.run(args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem.message}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
