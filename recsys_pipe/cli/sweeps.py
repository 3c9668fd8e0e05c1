"""The summary a `-m` sweep prints at its end: every job, its overrides, outcome and directory.

Why: each job logs into its own directory, so after a sweep of many jobs the console showed only
the last job's lines; the summary says in one place which jobs ran, which failed and where to
look, and how many did not start (a job that stops the sweep leaves the later ones unrun).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recsys_pipe.runtime.failures import EXIT_CONFIG_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED

__all__ = ["SweepJob", "SweepLog"]

_OUTCOMES = {
    EXIT_OK: "completed",
    EXIT_CONFIG_ERROR: "invalid config or input",
    EXIT_PREEMPTED: "preempted (checkpoint saved)",
    EXIT_INTERRUPTED: "interrupted",
}


@dataclass(frozen=True)
class SweepJob:
    """One job of a sweep and how it ended."""

    number: int
    overrides: tuple[str, ...]
    directory: str
    exit_code: int

    def describe(self) -> str:
        outcome = _OUTCOMES.get(self.exit_code, "failed")
        swept = " ".join(self.overrides) or "(no overrides)"
        return f"  job {self.number} [{swept}]: {outcome}, exit {self.exit_code} ({self.directory})"


@dataclass
class SweepLog:
    """The jobs of one sweep, in the order they ended."""

    jobs: list[SweepJob] = field(default_factory=list)
    #: the keys whose value differs between the jobs: what names a job in the summary
    swept: set[str] = field(default_factory=set)

    def record(self, job: tuple[int, list[str], str] | None, exit_code: int) -> None:
        """Record a job (`(number, its overrides, directory)`, None outside a sweep: ignored)."""
        if job is not None:
            number, overrides, directory = job
            named = tuple(o for o in overrides if o.split("=", 1)[0].lstrip("+~") in self.swept)
            self.jobs.append(SweepJob(number, named, directory, exit_code))

    def summary(self, prog: str, total: int) -> str:
        """A header line with the counts, then one line per job that ran."""
        ok = sum(1 for j in self.jobs if j.exit_code == EXIT_OK)
        unrun = max(total - len(self.jobs), 0)
        head = f"{prog}: sweep of {total} job(s): {ok} completed, {len(self.jobs) - ok} did not"
        if unrun:
            head += f", {unrun} not started"
        return "\n".join([head, *(j.describe() for j in self.jobs)])
