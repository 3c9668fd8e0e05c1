"""Ctrl-C while a command starts: a SIGINT handler that remembers the signal as well as raising
`KeyboardInterrupt`.

Why: some libraries import their optional parts under a bare `except:` (fbgemm-gpu's lookup
invokers do), which swallows the `KeyboardInterrupt` of a Ctrl-C that lands there; the command
would then go on and train as if nothing had been pressed. The console scripts install this
handler before they import anything heavy (`recsys_pipe.entry`), and the start-up calls
`raise_if_received()` at the points where it hands SIGINT over to training's own handling, so a
swallowed Ctrl-C still ends the start. Imports nothing but `signal`: it must be cheap to load.
"""

from __future__ import annotations

import signal
from types import FrameType

__all__ = ["install", "raise_if_received"]

_received = False


def _remember_and_raise(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = True
    raise KeyboardInterrupt


def install() -> None:
    """Make SIGINT raise `KeyboardInterrupt` (as Python's default) and remember that it came."""
    signal.signal(signal.SIGINT, _remember_and_raise)


def raise_if_received() -> None:
    """Raise the `KeyboardInterrupt` of a Ctrl-C that came since `install()`, in case a library
    caught it (once: the flag is cleared)."""
    global _received
    if _received:
        _received = False
        raise KeyboardInterrupt
