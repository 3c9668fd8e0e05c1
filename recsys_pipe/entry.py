"""The console scripts' entry points: each imports its CLI under a guard, so that a Ctrl-C while
the heavy modules load (torch, torchrec, Hydra: seconds at every start, on every rank) ends in
one line and exit code 130, not in a KeyboardInterrupt traceback from inside an import."""

from __future__ import annotations

import importlib
import os
import sys

from recsys_pipe import _ctrl_c

__all__ = ["data", "evaluate", "export", "plan", "profile", "train"]

#: Ctrl-C (SIGINT): 128 + 2, as `recsys_pipe.runtime.failures.EXIT_INTERRUPTED` (not imported: it loads torch)
_EXIT_INTERRUPTED = 130


def _run(module: str, prog: str) -> None:
    _ctrl_c.install()  # a Ctrl-C a library's bare `except:` swallows is still seen
    try:
        main = importlib.import_module(module).main
        _ctrl_c.raise_if_received()
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":  # every rank of a torchrun job gets the Ctrl-C: one line
            print(f"{prog}: interrupted (Ctrl-C) while starting; nothing was started", file=sys.stderr)
            sys.stderr.flush()
        os._exit(_EXIT_INTERRUPTED)
    code = main()
    if code:  # a command whose main returns its exit code (`recsys-data`)
        sys.exit(code)


def train() -> None:
    """`recsys-train`."""
    _run("recsys_pipe.cli.train", "recsys-train")


def plan() -> None:
    """`recsys-plan`."""
    _run("recsys_pipe.cli.plan", "recsys-plan")


def profile() -> None:
    """`recsys-profile`."""
    _run("recsys_pipe.cli.profile", "recsys-profile")


def evaluate() -> None:
    """`recsys-eval`."""
    _run("recsys_pipe.cli.eval", "recsys-eval")


def export() -> None:
    """`recsys-export`."""
    _run("recsys_pipe.cli.export", "recsys-export")


def data() -> None:
    """`recsys-data`."""
    _run("recsys_pipe.cli.data", "recsys-data")
