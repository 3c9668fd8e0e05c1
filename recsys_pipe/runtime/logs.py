"""Logging of a training process: rank 0 talks, every rank records its failures in train.log."""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["FILE_ONLY", "setup_logging"]

#: a record logged with `extra={FILE_ONLY: True}` goes to train.log only: its console line was
#: printed already, in another form (a bad input's `error: <key>: <message>`)
FILE_ONLY = "file_only"


class _OneLine(logging.Formatter):
    """Console format: the message without the traceback (which goes to train.log)."""

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text
        record.exc_info = record.exc_text = None
        try:
            return super().format(record)
        finally:
            record.exc_info, record.exc_text = saved


class _RunLog(logging.FileHandler):
    """train.log. A record it cannot write (a full disk) is reported once, in one line, instead
    of logging's "--- Logging error ---" and a traceback for every record; the console still
    gets every record."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        if not self.failed:
            self.failed = True
            error = sys.exc_info()[1]
            print(f"warning: cannot write {self.baseFilename}: {error}; the console gets the log", file=sys.stderr)


#: the train.log handlers setup_logging opened (closed by the next call)
_OWN_FILES: list[logging.FileHandler] = []


def setup_logging(rank: int, run_dir: str, debug: bool) -> None:
    """Rank 0: INFO to the console and train.log; other ranks: warnings and errors to both (so a
    failure is in train.log whichever rank saw it). Tracebacks only in train.log, unless debug."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    while _OWN_FILES:  # the previous job's train.log (a sweep): closed, not left to the garbage collector
        _OWN_FILES.pop().close()
    pattern = f"[%(asctime)s][rank {rank}][%(levelname)s] %(message)s"
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(pattern, "%H:%M:%S") if debug else _OneLine(pattern, "%H:%M:%S"))
    console.addFilter(lambda record: not getattr(record, FILE_ONLY, False))
    root.addHandler(console)
    file = _RunLog(os.path.join(run_dir, "train.log"))  # appends: one line per write
    file.setFormatter(logging.Formatter(pattern, "%H:%M:%S"))
    _OWN_FILES.append(file)
    root.addHandler(file)
    root.setLevel(logging.WARNING)
    logging.getLogger("recsys_pipe").setLevel(logging.INFO if rank == 0 else logging.WARNING)
