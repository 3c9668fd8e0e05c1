"""One rank's part of a run: the process group, the shared run directory, logging, the run's
`status.json`, dead-peer detection and the SIGTERM agreement, started together and closed
together, and every outcome (completed, preempted, interrupted, failed) recorded in one place.

    session = RunSession.start("recsys-train", settings, requested_dir)
    try:
        code = session.completed(...) / session.failed(exc) / session.interrupted(step)
    finally:
        session.close(code, keep_group=sweep)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from recsys_pipe.runtime.distributed import DistInfo, init_distributed, teardown
from recsys_pipe.runtime.failures import (
    EXIT_CONFIG_ERROR,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    config_error_in,
    is_communication_error,
    one_line,
    user_code_report,
)
from recsys_pipe.runtime.health import PeerFailure, PeerHealth
from recsys_pipe.runtime.logs import FILE_ONLY, setup_logging
from recsys_pipe.runtime.preemption import StopRequest
from recsys_pipe.runtime.rundir import shared_run_dir
from recsys_pipe.runtime.status import RunStatus

__all__ = ["RequestedDir", "RunSession", "SessionSettings"]

log = logging.getLogger("recsys_pipe")


class SessionSettings(Protocol):
    """The trainer settings a session reads (`recsys_pipe.train.TrainerConfig` has them all)."""

    device: str
    backend: str
    peer_timeout_s: float
    preemption_check_s: float
    output_dir: str


@dataclass(frozen=True)
class RequestedDir:
    """A run directory the launcher was told to use (`hydra.run.dir`, or a sweep job's), with the
    config key that named it; `sweep`: the process runs further jobs after this one."""

    path: str | None = None
    key: str = ""
    sweep: bool = False


@dataclass
class RunSession:
    """One rank's running session: what `RunSession.start` set up, and how the run ends.

    Attributes:
        info: this process's rank, world size, device and process groups.
        run_dir: the run directory every rank shares.
        status: the writer of `<run_dir>/status.json` (rank 0 writes).
        stop: the SIGTERM agreement between the ranks.
        health: dead-peer detection (None on one rank)."""

    info: DistInfo
    run_dir: str
    status: RunStatus
    stop: StopRequest
    health: PeerHealth | None = None
    #: the run ended at a step boundary on every rank (`completed`): the group can be left in order
    _clean_stop: bool = False

    @classmethod
    def start(
        cls, prog: str, settings: SessionSettings, requested: RequestedDir, debug: bool = False, **status: Any
    ) -> RunSession:
        """Join the process group and agree on the run directory (ConfigError if the requested
        one was taken meanwhile); `status` fields go into every status.json write."""
        info = init_distributed(settings.device, settings.backend, timeout_s=settings.peer_timeout_s)
        run_dir = shared_run_dir(settings.output_dir, prog, requested.path, requested.key)
        setup_logging(info.rank, run_dir, debug)
        stop = StopRequest(info.control_group, settings.preemption_check_s)
        session = cls(info, run_dir, RunStatus(run_dir, world_size=info.world_size, **status), stop)
        if info.is_main:
            session.status.write("running", pid=os.getpid())
        if info.world_size > 1:
            session.health = PeerHealth(
                PeerHealth.connect(settings.peer_timeout_s),
                run_dir,
                info.rank,
                info.world_size,
                settings.peer_timeout_s,
                on_fatal=lambda failure: session._record(failure, EXIT_FAILURE),
                exit_code=EXIT_FAILURE,
            ).start()
        stop.__enter__()  # SIGTERM handler from here until close()
        return session

    def completed(self, preempted: bool, **fields: Any) -> int:
        """Record a finished run (`fields`: step, checkpoint, eval...) and return its exit code:
        0, or for a run stopped by a signal after its checkpoint 75 (SIGTERM) or 130 (Ctrl-C)."""
        interrupted = preempted and self.stop.interrupted
        code = EXIT_INTERRUPTED if interrupted else EXIT_PREEMPTED if preempted else 0
        self._clean_stop = True
        if self.info.is_main:
            state = "interrupted" if interrupted else "preempted" if preempted else "completed"
            self.status.write(state, exit_code=code, **fields)
            if preempted:
                log.warning("exiting with code %d (%s, resumable from %s)", code, state, fields.get("checkpoint"))
        return code

    def interrupted(self, step: int, checkpoint: str | None) -> int:
        """Record a Ctrl-C that stopped the run at once after `step` (the last completed step):
        nothing more is saved; `checkpoint` is the newest complete one the run wrote before (or None).

        Returns:
            The exit code to end with, `EXIT_INTERRUPTED` (130)."""
        saved = f"resumable from {checkpoint}" if checkpoint else "no checkpoint was written"
        log.warning("interrupted (Ctrl-C): stopping after step %d, the last completed one; %s", step, saved)
        if self.info.is_main:
            self.status.write("interrupted", exit_code=EXIT_INTERRUPTED, step=step, checkpoint=checkpoint)
        return EXIT_INTERRUPTED

    def failed(self, exc: BaseException, owners: Mapping[str, str] | None = None) -> int:
        """Classify `exc`, record the job's first failure, log it; returns the exit code: 2 for bad
        input found late (a checkpoint that does not fit, an undeclared collective), else 1. A
        failure in the user's own code is logged with their frames (`user_code_report`; `owners`:
        source file -> config key of the user's components)."""
        bad_input = config_error_in(exc)
        code = EXIT_CONFIG_ERROR if bad_input is not None else EXIT_FAILURE
        report = user_code_report(exc, owners) if bad_input is None else None
        message = report.splitlines()[0].removeprefix("error: ") if report else one_line(bad_input or exc)
        failure = PeerFailure(self.info.rank, message)
        if self.health is not None and is_communication_error(exc):  # maybe a symptom of a peer's failure
            failure = self.health.diagnose() or failure
        first = self._record(failure, code)
        # bad input is on the console once already, as `error: <key>: <message>`: train.log only
        extra = {FILE_ONLY: bad_input is not None}
        if first.rank == self.info.rank and report is not None:  # the user's bug: their frames, on the console too
            log.error("training failed on rank %d:\n%s", self.info.rank, report, exc_info=exc)
        elif first.rank == self.info.rank:
            log.error("training failed on rank %d: %s", self.info.rank, first.message, exc_info=exc, extra=extra)
        elif first.message == message:  # the same error on every rank (a checkpoint's write, a collective's)
            log.error("rank %d failed first: %s (here too)", first.rank, first.message, exc_info=exc, extra=extra)
        else:
            log.error(
                "rank %d failed first: %s (seen here as %s)",
                first.rank,
                first.message,
                one_line(exc),
                exc_info=exc,
                extra=extra,
            )
        return code

    def _record(self, failure: PeerFailure, code: int) -> PeerFailure:
        """Report `failure` to the job; the rank whose report is the first writes status.json."""
        first, mine = self.health.report(failure) if self.health is not None else (failure, True)
        if mine:
            self.status.write("failed", exit_code=code, failed_rank=first.rank, message=first.message)
        return first

    def close(self, code: int, keep_group: bool = False) -> int:
        """Stop the SIGTERM agreement; after a success, tell the peers this rank is done and leave
        the process group (a sweep keeps it for its next job: `keep_group`). Returns the exit
        code, 1 if a peer failed while this rank was finishing."""
        self.stop.__exit__(None, None, None)
        if not self._clean_stop and code not in (0, EXIT_PREEMPTED):
            return code
        if self.health is not None:
            self.health.mark_done()
            self.health.stop()
        try:
            if keep_group:
                import torch.distributed as dist

                dist.barrier()
            else:
                teardown()
        except Exception as exc:  # a peer failed after this rank had finished its part
            log.error("a peer failed while rank %d was finishing: %s", self.info.rank, one_line(exc))
            return EXIT_FAILURE
        return code
