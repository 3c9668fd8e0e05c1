"""`recsys-bench NAME [ARGS...]`: run one benchmark of `BENCHMARKS` as if started with
`python -m <its module> ARGS...`; `recsys-bench --help` lists them."""

from __future__ import annotations

import runpy
import sys

from recsys_pipe.bench.registry import BENCHMARKS

__all__ = ["main", "usage"]


def usage() -> str:
    """The help text: the command line and every benchmark with its summary."""
    width = max(map(len, BENCHMARKS))
    lines = [
        "usage: recsys-bench NAME [ARGS...]   (NAME --help: that benchmark's options)",
        "",
        "Runs one benchmark as `python -m recsys_pipe.bench.NAME ARGS...` would. Benchmarks:",
        *(f"  {name:<{width}}  {b.summary}" for name, b in BENCHMARKS.items()),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark `argv[0]` with the arguments after it.

    Args:
        argv: the command line after the program name (default: `sys.argv[1:]`).

    Returns:
        0 for `--help`; 2 (usage on stderr) for a missing or unknown name. A benchmark that runs
        ends the process with its own exit status.
    """
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        (sys.stdout if argv else sys.stderr).write(usage())
        return 0 if argv else 2
    name, args = argv[0], argv[1:]
    if name not in BENCHMARKS:
        sys.stderr.write(f"recsys-bench: unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}\n")
        return 2
    module = BENCHMARKS[name].module
    sys.argv = [module, *args]  # runpy sets argv[0] to the module's file
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0
