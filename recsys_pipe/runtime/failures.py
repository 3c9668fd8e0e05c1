"""Exit codes, and what a failure is: bad input found late, a collective broken by a peer, or a
failure of this rank.

The classification walks the exception's cause chain by type: `ConfigError` (a checkpoint that
does not fit the model, an undeclared collective) is bad input; torch's `DistError` family is a
communication failure. gloo reports a peer that died or hung as a plain `RuntimeError` (from its
C++ transport), so for those the message is the only evidence: `_GLOO_PEER_ERRORS` lists the
fragments it uses, and is the one place where text decides.
"""

from __future__ import annotations

import sysconfig
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch.distributed as dist

from recsys_pipe.config import ConfigError, UserCodeError

__all__ = [
    "EXIT_CONFIG_ERROR",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "config_error_in",
    "is_communication_error",
    "one_line",
    "user_code_report",
    "user_frames",
]

#: Training finished (max_steps reached, epochs done or data exhausted).
EXIT_OK = 0
#: A failure after start-up: an exception on this rank, or a failed peer (see the run's status.json).
EXIT_FAILURE = 1
#: Every config or input error: a bad value, data file, output path or checkpoint (argparse's code).
EXIT_CONFIG_ERROR = 2
#: SIGTERM made every rank save a checkpoint and stop: resumable (sysexits' EX_TEMPFAIL,
#: "temporary failure, retry"; distinct from being killed by SIGTERM, which shells show as 143).
EXIT_PREEMPTED = 75
#: Ctrl-C (SIGINT): stopped after the last completed step, nothing saved (128 + SIGINT).
EXIT_INTERRUPTED = 130

#: what gloo's transport says when a peer is gone or stuck (it raises RuntimeError, not DistError)
_GLOO_PEER_ERRORS = ("Connection closed", "Connection reset", "Timed out", "timed out")


def _causes(exc: BaseException, implicit: bool = False) -> Iterator[BaseException]:
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or (seen.__context__ if implicit else None)


def config_error_in(exc: BaseException) -> ConfigError | None:
    """The ConfigError behind `exc` (itself, or what made a task fail), if any."""
    return next((e for e in _causes(exc) if isinstance(e, ConfigError)), None)


def is_communication_error(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) came from a collective, as a dead peer's would."""
    return any(
        isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(f in str(e) for f in _GLOO_PEER_ERRORS))
        for e in _causes(exc, implicit=True)
    )


def one_line(exc: BaseException) -> str:
    """`TaskFailedError: task 'x' failed on batch 4 ...: RuntimeError: <first line of the cause>`;
    a ConfigError as its problems; a user's builder's error as the key that named it and the error."""
    from recsys_pipe.engine import TaskFailedError

    if isinstance(exc, ConfigError):
        return "; ".join(str(p) for p in exc.problems)
    user = next((e for e in _causes(exc) if isinstance(e, UserCodeError)), None)
    if user is not None:
        return str(user)
    text = f"{type(exc).__name__}: {_first_line(exc)}"
    cause = exc.__cause__ if isinstance(exc, TaskFailedError) else None
    if cause is not None:
        text += f": {type(cause).__name__}: {_first_line(cause)}"
    return text


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""


#: where code that is not the user's lives: this package, the standard library, installed packages
_NOT_USER_CODE = tuple(
    {str(Path(__file__).resolve().parents[1])}
    | {str(Path(p).resolve()) for k in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_path(k))}
)


def user_frames(error: BaseException) -> list[str]:
    """The traceback frames of `error` in the user's own code (not this package's, not the
    standard library's or an installed package's), formatted as Python prints them."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not str(Path(f.filename).resolve()).startswith(_NOT_USER_CODE) and not f.filename.startswith("<")
    ]
    return traceback.StackSummary.from_list(frames).format()


def user_code_report(exc: BaseException, owners: Mapping[str, str] | None = None) -> str | None:
    """A user's code raised: one line naming the config key that named it and the exception, then
    the frames of the user's code (None when `exc` did not pass through the user's code).

    A builder's error says its key itself (`UserCodeError`). Otherwise the key is found from the
    frames: `owners` maps a source file to the key of the component defined there (`model.builder
    (my_pkg.models:build)`); the innermost user frame in one of them names it; a task failure of
    the plan adds the task's key (`pipeline.tasks.forward`)."""
    from recsys_pipe.engine import TaskFailedError

    user = next((e for e in _causes(exc) if isinstance(e, UserCodeError)), None)
    if user is not None:
        return "\n".join([f"error: {user}", *(line.rstrip("\n") for line in user_frames(user.error))])
    root = list(_causes(exc))[-1]
    frames = user_frames(root)
    if not frames:
        return None
    files = [f.filename for f in traceback.extract_tb(root.__traceback__)]
    owner = next(
        (owners[str(Path(f).resolve())] for f in reversed(files) if owners and str(Path(f).resolve()) in owners), None
    )
    failed = next((e for e in _causes(exc) if isinstance(e, TaskFailedError)), None)
    where = [f"pipeline.tasks.{failed.task}: {failed}"] if failed is not None else []
    head = (
        ": ".join(["error", *([owner] if owner else []), *where])
        + f" raised {type(root).__name__}: {_first_line(root)}"
    )
    return "\n".join([head, *(line.rstrip("\n") for line in frames)])
