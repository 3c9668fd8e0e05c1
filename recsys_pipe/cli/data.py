"""`recsys-data`: data set tools, one subcommand each (argparse; the work lives in
`recsys_pipe.data`).

- `recsys-data inspect PATH [--world-size N --batch-size B]`: a Parquet data set's schema,
  rows, row groups and sizes, and each rank's share and the batches per epoch
  (`recsys_pipe.data.inspect.describe`).

A bad input exits 2 with one line `error: <what>: <message>`.
"""

from __future__ import annotations

import argparse
import sys

from recsys_pipe.config import ConfigError

__all__ = ["main"]

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def _inspect(args: argparse.Namespace) -> int:
    from recsys_pipe.data.inspect import describe

    print(describe(args.path if len(args.path) > 1 else args.path[0], args.world_size, args.batch_size))
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recsys-data", description="Data set tools for recsys-train.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect = commands.add_parser(
        "inspect",
        help="schema, rows, row groups and sizes of Parquet files; with --world-size and --batch-size, each "
        "rank's share",
        description="Show a Parquet data set from its footers: schema, rows, row groups, sizes; with --world-size "
        "and --batch-size also the batches per epoch and each rank's rows.",
    )
    inspect.add_argument("path", nargs="+", help="file, directory, glob or URI (as data.path)")
    inspect.add_argument("--world-size", type=int, metavar="N", help="ranks sharing the data")
    inspect.add_argument("--batch-size", type=int, metavar="B", help="rows per batch per rank (data.batch_size)")
    inspect.set_defaults(run=_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `recsys-data`; returns its exit code (0 ok, 2 bad input or usage)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "inspect":
        if (args.world_size is None) != (args.batch_size is None):
            parser.error("--world-size and --batch-size go together")
        for name in ("world_size", "batch_size"):
            value = getattr(args, name)
            if value is not None and value < 1:
                parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        return args.run(args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem.message}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
