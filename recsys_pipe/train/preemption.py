"""Preemption: SIGTERM (what torchrun, SLURM and Kubernetes send before killing a job) asks
every rank to finish its current step, save a checkpoint and exit.

The signal reaches the ranks at slightly different times, but they must stop after the *same*
step, or the checkpoint's collectives would pair different steps. So each rank contributes its
flag to an all-reduce (max) issued after every step and waited for after the next one: the
decision is one step late but identical everywhere, and the all-reduce runs on its own gloo
group in the background, so it costs no wait in the training loop.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["StopRequest"]

log = logging.getLogger(__name__)


class StopRequest:
    """SIGTERM handler plus the cross-rank agreement on the step to stop after.

    Use as a context manager on the main thread (signal handlers can only be set there);
    call `should_stop()` once per completed step on every rank.

    Args:
        group: process group of the agreement all-reduce (None: single process).
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.requested = threading.Event()
        self.signal_name: str | None = None
        self._flag: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._previous: object = None
        self._depth = 0

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

    def request(self, reason: str) -> None:
        """Ask for a stop as SIGTERM would (for code that detects preemption otherwise)."""
        self.signal_name = reason
        self.requested.set()

    def should_stop(self) -> bool:
        """True on every rank after the same step once any rank was asked to stop."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return self.requested.is_set()
        if self._work is not None:
            self._work.wait()
            assert self._flag is not None
            if bool(self._flag.item()):
                self._work = None
                return True
        self._flag = torch.tensor([1 if self.requested.is_set() else 0], dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return False

    def drain(self) -> None:
        """Complete the outstanding all-reduce (every rank issued the same number)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
