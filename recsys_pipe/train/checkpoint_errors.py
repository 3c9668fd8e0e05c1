"""A checkpoint that cannot be written (a full disk, a read-only or vanished directory) as one
error naming the checkpoint and the OS error, with the partial save removed.

DCP reports a failed write as `CheckpointException`, a BaseException whose text is every rank's
traceback ("CheckpointException ranks:dict_keys([0, 1])" and 270 lines) and which never says
"No space left on device" in its first line. `writing_checkpoint` finds the `OSError` behind it
(in the exception's cause chain or in any rank's failure), removes the `.partial` directory (the
earlier checkpoints are untouched: they were published before this save began) and raises
`CheckpointWriteError`, whose one line says what happened; the run then ends as any failure does
(`status.json` failed with that line).

DCP sends each rank's failure to the coordinator and back by pickling it, which drops its
`__cause__` and `__context__`. A full disk met inside `torch.save` (DCP's `.distcp` writes) is a
`RuntimeError` ("unexpected pos 704 vs 598" from torch's zip writer) whose OSError is only its
context, so after that trip no rank could tell it from any other failure. The storage writer the
checkpointer uses (`recsys_pipe.train.checkpoint_writer`) therefore fails with the OSError itself.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = ["CheckpointWriteError", "os_error_in", "writing_checkpoint"]


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written: `path` (the checkpoint it would have become) and the
    `OSError` that stopped it."""

    def __init__(self, path: str | Path, error: OSError):
        self.path, self.error = str(path), error
        code = errno.errorcode.get(error.errno or 0, "")
        reason = f"{error.strerror} ({code})" if error.strerror else str(error)
        super().__init__(f"cannot write checkpoint {path}: {reason}; the partial save was removed")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.path, self.error))


def os_error_in(exc: BaseException) -> OSError | None:
    """The `OSError` behind `exc`: in its cause/context chain, or in a rank's failure of a DCP
    `CheckpointException` (`failures`: rank -> (exception, traceback) or exception)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        for failure in (
            getattr(current, "failures", {}).values() if isinstance(getattr(current, "failures", None), dict) else ()
        ):
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo += [current.__cause__, current.__context__]
    return None


@contextlib.contextmanager
def writing_checkpoint(final: Path, partial: Path, remove: bool) -> Iterator[None]:
    """Around the writing of one checkpoint (`partial`, to become `final`): an OS error becomes
    `CheckpointWriteError`, after the partial save is removed (`remove`: this rank removes it,
    rank 0). Other errors pass unchanged."""
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        error = os_error_in(exc)
        if error is None or isinstance(exc, KeyboardInterrupt):
            raise
        if remove:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointWriteError(final, error) from exc
