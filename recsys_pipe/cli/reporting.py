"""How the CLIs print a config error: `error: <path>: <message>` per problem and a one-line hint,
printed once per torchrun job (not once per rank)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from recsys_pipe.cli.sweep_dir import torchrun_store
from recsys_pipe.config import ConfigError

__all__ = ["debug_requested", "first_to_report", "report_config_error"]


def debug_requested(cfg: Any = None) -> bool:
    """Whether a traceback is wanted with the error lines: `HYDRA_FULL_ERROR=1` or `debug=true`."""
    if os.environ.get("HYDRA_FULL_ERROR", "") == "1":
        return True
    try:
        return bool(cfg is not None and cfg.get("debug", False) is True)
    except Exception:
        return False


_REPORTS = [0]


def first_to_report() -> bool:
    """Whether this process prints a config error that every rank of a torchrun job finds.

    Before the process group starts, each rank validates the same config and would print the
    same lines. The ranks agree through torchrun's own store (an atomic counter per report):
    the first rank to get there prints, the others stay silent. Outside torchrun: always. If
    the store cannot be reached, the first local rank prints.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True
    _REPORTS[0] += 1
    try:
        store = torchrun_store(timeout_s=10)
        key = f"recsys_pipe/report/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_REPORTS[0]}"
        first = store.add(key, 1) == 1
    except Exception:  # no store: one line per machine is still better than one per rank
        return os.environ.get("LOCAL_RANK", "0") == "0"
    if not first:  # let the reporting rank print before this one exits and torchrun stops the others
        time.sleep(1.0)
    return first


def report_config_error(
    error: ConfigError, prog: str, stream: Any = None, started: bool = False, outcome: str | None = None
) -> None:
    """Print `error: <path>: <message>` per problem plus a one-line hint (`started`: found after
    the run started, e.g. a checkpoint that does not fit; `outcome` says what happened instead
    of "nothing was started"). Under torchrun, one rank prints (`first_to_report`)."""
    if not first_to_report():
        return
    stream = stream or sys.stderr
    for p in error.problems:
        print(f"error: {p}", file=stream)
    n = len(error.problems)
    outcome = outcome or ("the run stopped" if started else "nothing was started")
    print(
        f"{prog}: {n} config error{'s' if n != 1 else ''}, {outcome}. "
        f"`{prog} --help` lists the groups and keys; debug=true shows a traceback.",
        file=stream,
    )
