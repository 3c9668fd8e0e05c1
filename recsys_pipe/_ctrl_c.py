"""Ctrl-C at any moment of a command: a SIGINT handler that remembers the signal as well as
raising `KeyboardInterrupt`, one that only remembers it, and the pause points of its tests.

Why remember: some libraries import their optional parts under a bare `except:` (fbgemm-gpu's
lookup invokers do), which swallows the `KeyboardInterrupt` of a Ctrl-C that lands there; the
command would then go on and train as if nothing had been pressed. The console scripts install
this handler before they import anything heavy (`recsys_pipe.entry`), and the start-up calls
`raise_if_received()` at the points where it hands SIGINT over to training's own handling, so a
swallowed Ctrl-C still ends the start. Once a command's outcome is decided (its check passed,
its run recorded), a Ctrl-C no longer raises but is still remembered (`record`), and the
command exits 130 (`settle`): never ignored, so `scripts/train.sh` does not go on to torchrun.

Imports nothing but the standard library: it must be cheap to load.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType

__all__ = ["PAUSE_ENV", "install", "pause_point", "raise_if_received", "record", "settle"]

#: Ctrl-C (SIGINT): 128 + 2, as `recsys_pipe.runtime.failures.EXIT_INTERRUPTED`
_EXIT_INTERRUPTED = 130
#: names a moment (`pause_point`) at which a command waits, for the tests that Ctrl-C it there
PAUSE_ENV = "RECSYS_PIPE_PAUSE_AT"
#: the longest a pause point waits for a test's signal
_PAUSE_S = 60.0

_received = False
_paused: set[str] = set()


def _remember(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = True


def _remember_and_raise(signum: int, frame: FrameType | None) -> None:
    _remember(signum, frame)
    raise KeyboardInterrupt


def install() -> None:
    """Make SIGINT raise `KeyboardInterrupt` (as Python's default) and remember that it came."""
    signal.signal(signal.SIGINT, _remember_and_raise)


def record() -> None:
    """Make SIGINT only remember that it came (a command finishing: `exit_code` says 130)."""
    signal.signal(signal.SIGINT, _remember)


def raise_if_received() -> None:
    """Raise the `KeyboardInterrupt` of a Ctrl-C that came since `install()`, in case a library
    caught it (once: the flag is cleared)."""
    global _received
    if _received:
        _received = False
        raise KeyboardInterrupt


def settle(code: int) -> int:
    """A finished command's (or sweep job's) exit code: 130 for one that would exit 0 but saw a
    Ctrl-C it recorded; the record is consumed (a process that goes on, a test's or a sweep's,
    starts its next run without it)."""
    global _received
    received, _received = _received, False
    return _EXIT_INTERRUPTED if code == 0 and received else code


def pause_point(moment: str) -> None:
    """Where `$RECSYS_PIPE_PAUSE_AT` names `moment`, say so on stderr (`paused at <moment>`) and
    wait for a SIGINT, handled as the handler in place at this moment handles it (a test sends
    its Ctrl-C at exactly this moment); a no-op otherwise."""
    if os.environ.get(PAUSE_ENV) != moment or moment in _paused:
        return
    _paused.add(moment)  # once: the moment may come again after the signal (a stop's own checkpoint)
    previous = signal.getsignal(signal.SIGINT)
    arrived = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        arrived.append(signum)
        signal.signal(signal.SIGINT, previous)
        if callable(previous):
            previous(signum, frame)  # the moment's own handling (it may raise KeyboardInterrupt)

    signal.signal(signal.SIGINT, on_signal)
    try:
        print(f"paused at {moment}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + _PAUSE_S
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        if signal.getsignal(signal.SIGINT) is on_signal:
            signal.signal(signal.SIGINT, previous)
