"""Dead peers: every rank learns which rank failed, and exits within a bounded time.

Why this exists: when one rank dies, the others are usually blocked in a collective with it.
gloo raises "Connection closed by peer" without saying which rank that was; a rank that hangs
makes the others wait for the collective timeout; a rank that raised may take its peers down
before it has said why; and without torchrun nobody kills the survivors. So the ranks keep a
little shared state in the rendezvous store (the TCP store every rank already talks to):

- a heartbeat per rank, bumped by a daemon thread every `interval` seconds, with the step the
  rank is at;
- `first_failure`: set once, atomically (`compare_set`), by the first rank to report a failure;
  every later report names that rank as the root cause;
- `done/<rank>` when a rank finishes normally, so its silence afterwards is not a failure.

The same thread is a watchdog: when a peer has reported a failure, or its heartbeat has not
moved for `timeout_s`, it gives the main thread `grace_s` to fail by itself (usually at once: its
collective errors out), then logs which rank failed, records it, and ends the process with
`os._exit`, so no rank is left waiting behind a dead one.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["PeerFailure", "PeerHealth"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerFailure:
    """Which rank failed (`rank`) and what it or its peers know about it (`message`)."""

    rank: int
    message: str

    def __str__(self) -> str:
        return f"rank {self.rank} {self.message}"


class PeerHealth:
    """Heartbeats, failure reports and the watchdog of one rank (see the module docstring).

    Args:
        store: a client of the rendezvous store (`connect` makes one from MASTER_ADDR/PORT).
        prefix: keys of this job (a run directory name): sweeps reuse one store.
        rank, world_size: this process's place in the job.
        timeout_s: a peer whose heartbeat has not moved this long is declared dead.
        on_fatal: called by the watchdog with the peer failure before it ends the process
            (e.g. to record the run's status); must not block.
        exit_code: the watchdog's exit code.
    """

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        on_fatal: Callable[[PeerFailure], None] | None = None,
        exit_code: int = 1,
    ):
        self.store = store
        self.prefix = f"recsys_pipe/{prefix}/"
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.interval = min(1.0, timeout_s / 10)
        self.grace_s = min(10.0, timeout_s / 2)
        self.on_fatal = on_fatal
        self.exit_code = exit_code
        #: the step this rank is at (the trainer updates it; heartbeats carry it)
        self.step = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def connect(timeout_s: float) -> dist.Store:
        """A new client of the store at MASTER_ADDR:MASTER_PORT (torchrun's agent store, or the
        one rank 0 hosts), with its own connection for the watchdog thread."""
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    def _key(self, name: str) -> str:
        return self.prefix + name

    # -- reports ----------------------------------------------------------------------------------

    def report(self, failure: PeerFailure) -> tuple[PeerFailure, bool]:
        """Record `failure` (this rank's, or a peer's it diagnosed) unless another was recorded
        first; returns the job's first failure and whether it is this report."""
        mine = f"{failure.rank}:{failure.message}"
        try:
            winner = self.store.compare_set(self._key("first_failure"), "", mine).decode()
        except Exception:  # the store is gone (its host died): this report is all we have
            return failure, True
        rank, _, text = winner.partition(":")
        return PeerFailure(int(rank), text), winner == mine

    def first_failure(self) -> PeerFailure | None:
        """The first failure any rank reported, or None."""
        key = self._key("first_failure")
        if not self.store.check([key]):
            return None
        rank, _, text = self.store.get(key).decode().partition(":")
        return PeerFailure(int(rank), text)

    def diagnose(self, wait_s: float | None = None) -> PeerFailure | None:
        """Who failed, from the store: a reported failure, else a peer whose heartbeat stops
        (watched for `wait_s`, default 2.5 heartbeats), else a peer that is behind in steps."""
        wait_s = 2.5 * self.interval if wait_s is None else wait_s
        before = self._beats()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            failure = self.first_failure()
            if failure is not None:
                return failure
            time.sleep(self.interval / 4)
        after = self._beats()
        silent = [r for r in self._peers() if before.get(r) == after.get(r) and not self._done(r)]
        if silent:
            step = after.get(silent[0], (0, 0))[1]
            return PeerFailure(
                silent[0], f"stopped responding (no heartbeat; last reported at step {step}): killed, crashed or hung"
            )
        steps = {r: after[r][1] for r in self._peers() if r in after}
        if steps and min(steps.values()) < self.step:
            laggard = min(steps, key=steps.get)
            return PeerFailure(laggard, f"stopped making progress at step {steps[laggard]} (hung?)")
        return None

    def mark_done(self) -> None:
        """This rank finished normally: its silence from now on is not a failure."""
        self._stop.set()
        try:
            self.store.set(self._key(f"done/{self.rank}"), "1")
        except Exception:
            pass

    # -- watchdog ---------------------------------------------------------------------------------

    def start(self) -> PeerHealth:
        """Write the first heartbeat and start the watchdog thread; returns `self`."""
        self._beat()
        self._thread = threading.Thread(target=self._watch, name="recsys_pipe:health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the watchdog thread (waits for it at most a little over two heartbeat intervals)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
            self._thread = None

    def _watch(self) -> None:
        last_change: dict[int, tuple[tuple[int, int], float]] = {}
        suspect: tuple[PeerFailure, float] | None = None
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                failure = self.first_failure()
                now = time.monotonic()
                if failure is None:
                    for rank, beat in self._beats().items():
                        seen = last_change.get(rank)
                        if seen is None or seen[0] != beat:
                            last_change[rank] = (beat, now)
                        elif now - seen[1] > self.timeout_s and not self._done(rank):
                            failure = PeerFailure(
                                rank,
                                f"stopped responding (no heartbeat for {self.timeout_s:g} s; last reported at step "
                                f"{beat[1]}): killed, crashed or hung",
                            )
                            break
            except Exception as exc:  # the store itself is unreachable: its host is gone
                failure = PeerFailure(-1, f"the rendezvous store is unreachable ({type(exc).__name__}: {exc})")
                now = time.monotonic()
            if failure is None or failure.rank == self.rank:
                continue
            if suspect is None:
                suspect = (failure, now)
            if now - suspect[1] >= self.grace_s:  # the main thread did not end the process itself
                self._die(suspect[0])

    def _die(self, failure: PeerFailure) -> None:
        who = "the rendezvous store's host" if failure.rank < 0 else f"rank {failure.rank}"
        log.error("%s failed: %s; rank %d exits (code %d)", who, failure.message, self.rank, self.exit_code)
        if self.on_fatal is not None:
            try:
                self.on_fatal(failure)
            except Exception:
                pass
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(self.exit_code)

    # -- heartbeats -------------------------------------------------------------------------------

    def _beat(self) -> None:
        self.store.set(self._key(f"beat/{self.rank}"), f"{time.monotonic_ns()}:{self.step}")

    def _beats(self) -> dict[int, tuple[int, int]]:
        keys = [self._key(f"beat/{r}") for r in self._peers()]
        present = [k for k in keys if self.store.check([k])]
        values = self.store.multi_get(present) if present else []
        out = {}
        for key, value in zip(present, values):
            stamp, _, step = value.decode().partition(":")
            out[int(key.rsplit("/", 1)[1])] = (int(stamp), int(step))
        return out

    def _done(self, rank: int) -> bool:
        return self.store.check([self._key(f"done/{rank}")])

    def _peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]
