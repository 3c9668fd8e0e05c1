"""Preemption: SIGTERM (what torchrun, SLURM and Kubernetes send before killing a job) asks
every rank to finish its current step, save a checkpoint and exit (75); while training, Ctrl-C
(SIGINT) does the same and exits 130 (`StopRequest.interrupts`).

The signal reaches the ranks at slightly different times, but they must stop after the *same*
step, or the checkpoint's collectives would pair different steps. So the ranks combine their
flags in an all-reduce (max) on a gloo group of their own, issued at a check step and waited
for at the next one: the decision is late by one check interval but identical everywhere, and
the all-reduce runs in the background, so it costs no wait in the training loop. It carries the
signal (the larger number where ranks got different ones), so every rank ends with the same
exit code even if only one of them was signalled.

The check interval adapts to the step time (about `check_every_s` between checks, at least
every step; `trainer.preemption_check_s`): an all-reduce every step cost short steps several
percent on a small machine. The interval travels in the same all-reduce, so every rank schedules
the next check at the same step.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["CtrlC", "StopRequest"]

log = logging.getLogger(__name__)


class StopRequest:
    """SIGTERM handler plus the cross-rank agreement on the step to stop after.

    Use as a context manager on the main thread (signal handlers can only be set there);
    call `should_stop()` once per completed step on every rank.

    Args:
        group: process group of the agreement all-reduce (None: single process).
        check_every_s: seconds between two agreement all-reduces (0: every step); the stop
            decision lags the signal by up to twice this.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, check_every_s: float = 0.5):
        self.group = group
        self.check_every_s = check_every_s
        self.requested = threading.Event()
        self.signal_name: str | None = None
        self._flag: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._previous: object = None
        self._depth = 0
        self._steps = 0  # should_stop() calls so far
        self._next_check = 1
        self._last_check: tuple[int, float] = (0, time.monotonic())

    def __enter__(self) -> StopRequest:
        """Install the SIGTERM handler (nested entries keep the outermost one)."""
        if self._depth == 0 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0 and self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
            self._previous = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested.is_set():
            self.signal_name = signal.Signals(signum).name
            self.requested.set()

    @contextlib.contextmanager
    def interrupts(self) -> Iterator[None]:
        """Inside: Ctrl-C (SIGINT) is a stop request too, as SIGTERM is (the step in flight is
        finished and checkpointed), and a second Ctrl-C is the KeyboardInterrupt of an immediate
        stop; outside, SIGINT keeps its handler (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGINT, self._on_interrupt)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set() and self.interrupted:
            raise KeyboardInterrupt
        self._on_signal(signum, frame)

    @property
    def interrupted(self) -> bool:
        """Whether the stop was a Ctrl-C (SIGINT) rather than SIGTERM or a request."""
        return self.signal_name == signal.SIGINT.name

    def _signal_number(self) -> int:
        """What this rank puts into the agreement: 0, or the signal (a request counts as SIGTERM)."""
        if not self.requested.is_set():
            return 0
        try:
            return int(signal.Signals[self.signal_name or ""])
        except KeyError:
            return int(signal.SIGTERM)

    def request(self, reason: str) -> None:
        """Ask for a stop as SIGTERM would (for code that detects preemption otherwise)."""
        self.signal_name = reason
        self.requested.set()

    def should_stop(self) -> bool:
        """True on every rank after the same step once any rank was asked to stop."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return self.requested.is_set()
        self._steps += 1
        if self._steps < self._next_check:
            return False
        interval = 1
        if self._work is not None:
            self._work.wait()
            assert self._flag is not None
            stop, interval = (int(v) for v in self._flag.tolist())
            if stop:
                self._work = None
                self.signal_name = self.signal_name or signal.Signals(stop).name  # a peer's signal
                return True
        now = time.monotonic()
        steps, then = self._last_check
        per_step = (now - then) / max(1, self._steps - steps)
        proposal = max(1, min(1000, int(self.check_every_s / max(per_step, 1e-6))))
        self._last_check = (self._steps, now)
        self._flag = torch.tensor([self._signal_number(), proposal], dtype=torch.int64)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._next_check = self._steps + max(1, interval)
        return False

    def drain(self) -> None:
        """Complete the outstanding all-reduce (every rank issued the same ones)."""
        if self._work is not None:
            self._work.wait()
            self._work = None


class CtrlC:
    """Ctrl-C (SIGINT) as Python's own KeyboardInterrupt, except while a failure is being handled.

    Why: under torchrun a Ctrl-C reaches every rank, and the first rank to stop closes its
    connections, so another rank blocked in a collective can fail ("Connection closed by peer")
    before its own Ctrl-C is handled: the interpreter runs that handler only when the failed call
    returns, and raising then would break out of the failure handling. `during_failure()` turns
    the handler off (a Ctrl-C is then only recorded), lets a pending one run, and says whether one
    arrived, so that rank reports the interruption, as the others do.

    Use as a context manager on the main thread; elsewhere it installs nothing.
    """

    def __init__(self) -> None:
        self.seen = False
        self._recording = False
        self._previous: object = None
        self._installed = False

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_signal)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed and signal.getsignal(signal.SIGINT) == self._on_signal:
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.seen = True
        if not self._recording:
            raise KeyboardInterrupt

    def during_failure(self) -> bool:
        """Called first thing when handling a failure: whether a Ctrl-C arrived (a pending one is
        handled now, and recorded instead of raised)."""
        self._recording = True
        time.sleep(0)  # a call: the interpreter runs pending signal handlers after it
        return self.seen
