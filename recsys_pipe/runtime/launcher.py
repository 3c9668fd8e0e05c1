"""`python -m recsys_pipe.runtime.launcher [torchrun's arguments]`: torchrun, with Ctrl-C and
SIGTERM passed on to the workers once and the workers' exit code as its own.

Why not torchrun itself: its agent starts each worker in a session of its own (a terminal's
Ctrl-C reaches only the agent), turns SIGINT/SIGTERM into an exception, signals the workers, kills
them 30 s later whatever they were doing (a checkpoint being written), and exits 1 with two
tracebacks. A worker of `recsys-train` stops cleanly on either signal: it finishes the step in
flight, every rank saves the checkpoint, and it exits 130 (Ctrl-C) or 75 (SIGTERM). So this
launcher runs torchrun's own `torch.distributed.run.run` (same arguments, same rendezvous, same
agent and restarts) in this process with
SIGINT and SIGTERM left to it: it passes each signal on to every worker's process group (a
worker stops once, however many signals it gets), waits for the workers however long their
checkpoint takes, and exits with their code: 0, 75, 130 or, when a worker failed, its code (1,
2). A signal that arrives before any worker runs ends it at once: 130 or 143 (128 + the
signal), in one line.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

__all__ = ["exit_code_of", "main", "worker_pids"]

#: the signals passed on to the workers
FORWARDED = (signal.SIGINT, signal.SIGTERM)
#: whether a signal was passed on to the workers (set by the handler)
_STOPPING = False


def worker_pids() -> list[int]:
    """The processes this one started (the agent's workers): children of this pid, from /proc.

    Why /proc: the agent keeps its worker processes inside `launch_agent`; the children of this
    process are exactly them (the agent runs here and starts nothing else)."""
    me = os.getpid()
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # the process ended meanwhile
            continue
        if int(fields[1]) == me:  # field 4 of /proc/<pid>/stat: the parent
            pids.append(int(stat.parent.name))
    return pids


#: the workers' codes of a clean stop: every rank finished its step and saved the checkpoint
CLEAN_STOPS = (75, 130)


def exit_code_of(codes: Sequence[int], stopping: bool = False) -> int:
    """The launcher's code from its workers' exit codes: theirs when they agree, else a real
    failure's (1 before 2 before the rest). A worker killed by signal N (a negative code) counts
    as 128 + N, as a shell shows it, except while `stopping` (a signal was passed on): once one
    worker has stopped cleanly the agent terminates the others, which are only leaving by then."""
    if stopping:
        clean = [c for c in codes if c in CLEAN_STOPS]
        if clean and all(c in CLEAN_STOPS or c <= 0 for c in codes):
            return max(clean)
    normal = [128 - c if c < 0 else c for c in codes if c != 0]
    if not normal:
        return 0
    if len(set(normal)) == 1:
        return normal[0]
    for code in (1, 2):
        if code in normal:
            return code
    return max(normal)


def _forward(signum: int, frame: FrameType | None) -> None:
    """SIGINT/SIGTERM handler: pass the signal on to every worker's process group; with no
    worker running (the launcher is starting, or in the rendezvous) there is nothing to save:
    exit at once."""
    global _STOPPING
    pids = worker_pids()
    if not pids:
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"interrupted ({what}) before the workers started; nothing was started", file=sys.stderr)
        sys.stderr.flush()
        os._exit(128 + signum)
    _STOPPING = True
    for pid in pids:
        try:
            os.killpg(pid, signum)  # each worker leads its own session (the agent's choice)
        except ProcessLookupError:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun's agent with `argv` (torchrun's own arguments); returns the workers' code."""
    for sig in FORWARDED:
        signal.signal(sig, _forward)
    # the agent's lines about its workers' exits (codes 1, 75, 130; the others it terminates)
    # repeat what the workers said themselves; a worker killed by a signal says nothing, so the
    # launcher names it (below)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    # the agent's own handlers (an exception, then SIGKILL 30 s later) only for the other signals
    forwarded = {sig.name for sig in FORWARDED}
    args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",") if s.strip() not in forwarded)
    try:
        run(args)  # torchrun's own `run`: rendezvous, agent, workers
    except ChildFailedError as exc:
        code = exit_code_of([failure.exitcode for failure in exc.failures.values()], _STOPPING)
        if code > 128 and not _STOPPING:  # killed (out of memory, by hand): no worker could say so
            for rank, failure in sorted(exc.failures.items()):
                if failure.exitcode < 0:
                    name = signal.Signals(-failure.exitcode).name
                    print(f"rank {rank} was killed by {name} (exit {128 - failure.exitcode})", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
