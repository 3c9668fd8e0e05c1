"""How a run ended, at a glance: `<run dir>/status.json` (the exit codes it records are defined
by the CLI, `recsys_pipe.cli.app`).

`status.json` is written when the run starts (`running`) and replaced (atomically) when it ends:
`completed`, `failed` (with the message and the rank that failed first), `interrupted` (Ctrl-C)
or `preempted` (SIGTERM; a checkpoint to resume from). A run directory whose status still says
`running` after its processes are gone was killed without a chance to write (SIGKILL).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import socket
from typing import Any

__all__ = ["RunStatus"]

log = logging.getLogger("recsys_pipe")


class RunStatus:
    """Writes `<run_dir>/status.json`; every write replaces the file atomically.

    Args:
        run_dir: the run directory.
        info: what stays the same for the run (world size, resumed_from, ...).
    """

    FILE = "status.json"

    def __init__(self, run_dir: str, **info: Any):
        self.path = os.path.join(run_dir, self.FILE)
        self.info = {"started": _now(), "host": socket.gethostname(), **info}

    def write(self, status: str, **fields: Any) -> bool:
        """Replace `status.json` with `status`, the run's fixed fields, the time and `fields`.

        On a full disk the atomic replace needs room for a second file, so the record is then
        written over the existing file in place, within the blocks it already holds (a record is
        far under a block). A write that still fails (the directory gone) is a warning, not an
        error: the record is a summary of how the run ended, which the log says too, and raising
        here would bury the run's own error (often the same full disk) under this one.

        Args:
            status: the run's state, e.g. `running`, `completed`, `preempted`, `failed`.
            **fields: further keys of this record (exit code, step, error, ...).

        Returns:
            whether the record was written."""
        text = json.dumps({"status": status, **self.info, "updated": _now(), **fields}, indent=2) + "\n"
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
            return True
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            error = exc
        if error.errno in (errno.ENOSPC, errno.EDQUOT) and os.path.exists(self.path):
            try:
                with open(self.path, "r+") as f:
                    f.write(text)
                    f.truncate()
                return True
            except OSError as exc:
                error = exc
        log.warning("could not record status %r in %s: %s", status, self.path, error.strerror or error)
        return False

    def read(self) -> dict[str, Any] | None:
        """The last record written, or None when there is none (or it cannot be read)."""
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")
