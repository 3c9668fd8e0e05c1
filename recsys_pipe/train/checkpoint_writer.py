"""The storage writer of a run's checkpoints: DCP's `FileSystemWriter`, whose failed writes fail
with the `OSError` behind them.

DCP sends a rank's failure to the coordinator and back by pickling it, which drops the
exception's `__cause__` and `__context__`. A full disk met inside `torch.save` (DCP's `.distcp`
files) is a `RuntimeError` from torch's zip writer ("unexpected pos 704 vs 598") whose
`OSError` is only its context, so after that trip no rank could tell it from any other failure
(`recsys_pipe.train.checkpoint_errors.writing_checkpoint` finds none). An `OSError` keeps its
errno and message across the pickling.

Its own module because importing DCP takes most of a second, which a config's validation
(`CheckpointConfig`) should not pay: the checkpointer imports it when it saves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from recsys_pipe.train.checkpoint_errors import os_error_in

__all__ = ["OSErrorKeepingWriter"]


class OSErrorKeepingWriter(FileSystemWriter):
    """`FileSystemWriter` (same arguments) whose data and metadata writes fail with the `OSError`
    behind a failure when there is one (the module docstring says why)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        with _failing_with_os_error():
            return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        with _failing_with_os_error():
            super().finish(metadata, results)


@contextlib.contextmanager
def _failing_with_os_error() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        error = os_error_in(exc)
        if error is None or error is exc:
            raise
        # a new OSError of the same errno (OSError picks the subclass, e.g. PermissionError), not
        # `error` itself: raising that from `exc` would make its context and cause a cycle
        raise OSError(error.errno, error.strerror, error.filename) from exc
