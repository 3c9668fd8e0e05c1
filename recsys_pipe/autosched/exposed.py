"""TaskProfiler: how much of the iteration time each task is responsible for (its exposed time).

    exposed(T) = median iteration time of the plan runner as configured
                 - median iteration time with T shortcut (skipped and replayed)

On the serial plan that is T's own cost. On a plan with lookaheads it is what T adds to the critical
path: a task that overlaps other work (another thread, another stream, a later batch) shows
about 0, however long it runs; a task on the critical path shows its full cost. It answers
"would this plan be faster if T were free?", which per-task times alone cannot.

Each measurement is a full pass of `make_batches()` through the plan runner with a `CostProfiler`
installed: the baseline pass also gives the per-task costs (`ProfileResult.costs`), and every
pass measures the same steady-state iterations. A task that cannot be replayed (effects
outside its slots without a `DeclaredIO`) is not measured; `not_measured` says why.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from recsys_pipe.autosched.costs import CostModel
from recsys_pipe.autosched.profiler import CostProfiler, TaskInstance
from recsys_pipe.engine import PlanRunner, shortcut_refusal

__all__ = ["ProfileResult", "TaskProfiler"]


@dataclass
class ProfileResult:
    """What `TaskProfiler.profile_many` measured.

    Attributes:
        baseline_s: median iteration time of the plan runner as configured.
        exposed_s: task -> `max(0, baseline_s - shortcut_s[task])`.
        shortcut_s: task -> median iteration time with that task shortcut.
        not_measured: task -> why its exposed time could not be measured.
        costs: per-task costs from the baseline pass (`CostProfiler.cost_model`).
        instances: the baseline pass's task instances (for traces and timelines).
        iteration_spans: host-time (start, end) of the baseline pass's measured iterations.
        warmup, iters, rounds: how it was measured.
    """

    baseline_s: float
    exposed_s: dict[str, float]
    shortcut_s: dict[str, float]
    not_measured: dict[str, str]
    costs: CostModel
    warmup: int
    iters: int
    rounds: int = 1
    instances: list[TaskInstance] = field(default_factory=list, repr=False)
    iteration_spans: list[tuple[float, float]] = field(default_factory=list, repr=False)

    def window(self, last: int | None = None) -> tuple[float, float]:
        """Host-time span of the measured iterations of the baseline pass (the last `last`)."""
        spans = self.iteration_spans[-last:] if last else self.iteration_spans
        if not spans:
            raise ValueError("no measured iteration")
        return spans[0][0], spans[-1][1]

    def share(self, task: str) -> float | None:
        """Exposed time of `task` as a fraction of the iteration, or None if not measured."""
        if task not in self.exposed_s or self.baseline_s <= 0:
            return None
        return self.exposed_s[task] / self.baseline_s

    def report(self) -> str:
        """The table: per task its stream, thread, lookahead, median host and device time,
        exposed time and its share of the iteration; then the reasons for unmeasured tasks."""
        header = ("task", "stream", "thread", "la", "cpu ms", "device ms", "exposed ms", "share")
        rows = []
        for name, cost in self.costs.tasks.items():
            share = self.share(name)
            rows.append(
                (
                    name,
                    cost.stream or "-",
                    cost.thread or "-",
                    "-" if cost.lookahead is None else str(cost.lookahead),
                    f"{cost.cpu_s * 1e3:.3f}",
                    f"{cost.device_s * 1e3:.3f}",
                    f"{self.exposed_s[name] * 1e3:.3f}" if name in self.exposed_s else "n/a",
                    f"{share:.1%}" if share is not None else "n/a",
                )
            )
        widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(header)]
        numeric = {3, 4, 5, 6, 7}

        def line(cells: Sequence[str]) -> str:
            return "  ".join(c.rjust(w) if k in numeric else c.ljust(w) for k, (c, w) in enumerate(zip(cells, widths)))

        lines = [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]
        lines.append(
            f"iteration: {self.baseline_s * 1e3:.3f} ms (median of {self.iters} after {self.warmup} warm-up"
            f"{f', {self.rounds} rounds' if self.rounds > 1 else ''}); exposed = iteration - iteration with "
            "the task replayed"
        )
        if self.costs.outside_tasks_mean_s is not None:
            lines.append(
                f"outside tasks: {self.costs.outside_tasks_s * 1e3:.3f} ms per iteration (median; mean "
                f"{self.costs.outside_tasks_mean_s * 1e3:.3f}; fetching the batch, rotating the ring, on the "
                "calling thread)"
            )
        for reason in self.not_measured.values():
            lines.append(f"n/a: {reason}")
        return "\n".join(lines)

    def print_report(self, file: IO[str] | None = None) -> None:
        """Print `report()` to `file` (standard output by default)."""
        print(self.report(), file=file or sys.stdout)

    def to_json(self, path: str | os.PathLike | None = None, indent: int = 2) -> str:
        """The JSON text (also written to `path` when given)."""
        data: dict[str, Any] = {
            "baseline_s": self.baseline_s,
            "exposed_s": self.exposed_s,
            "shortcut_s": self.shortcut_s,
            "share": {name: self.share(name) for name in self.exposed_s},
            "not_measured": self.not_measured,
            "warmup": self.warmup,
            "iters": self.iters,
            "rounds": self.rounds,
            "tasks": {
                name: {
                    "stream": c.stream,
                    "thread": c.thread,
                    "lookahead": c.lookahead,
                    "cpu_s": c.cpu_s,
                    "device_s": c.device_s,
                }
                for name, c in self.costs.tasks.items()
            },
        }
        text = json.dumps(data, indent=indent)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text


class TaskProfiler:
    """Measures the exposed time of a plan runner's tasks by shortcut replay.

    Args:
        runner: the plan runner to measure, idle (between iterator passes); it is driven over
            fresh iterators and left with no shortcut enabled and its own observer restored.
        make_batches: returns a fresh iterable of batches for one pass, at least
            `batches_needed` long (more is measured too, just not used); every rank of a
            distributed run must get the same number.
        warmup: iterations of each pass before measuring (raised to the runner's max
            lookahead, so that only steady-state iterations count).
        iters: iterations measured per pass.
        rounds: baseline-then-every-task passes; the medians over rounds are reported (more
            rounds: less sensitive to a machine that slows down midway).
    """

    def __init__(
        self,
        runner: PlanRunner,
        make_batches: Callable[[], Iterable[Any]],
        warmup: int = 3,
        iters: int = 20,
        *,
        rounds: int = 1,
    ):
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.runner = runner
        self.make_batches = make_batches
        self.warmup = max(warmup, runner.max_lookahead)
        self.iters = iters
        self.rounds = rounds

    @property
    def batches_needed(self) -> int:
        """Batches per pass: warm-up plus measured iterations, all in the steady state."""
        return self.warmup + self.iters

    def profile(self, name: str) -> float:
        """Exposed time of one task, in seconds; ValueError if it cannot be shortcut."""
        result = self.profile_many([name])
        if name in result.not_measured:
            raise ValueError(result.not_measured[name])
        return result.exposed_s[name]

    def profile_many(self, names: Iterable[str] | None = None) -> ProfileResult:
        """Baseline pass plus one pass per task (default: every task of the runner); tasks that
        cannot be shortcut are listed in `not_measured` with the reason. `names=[]` measures
        the baseline and the costs only."""
        order = [t.name for t in self.runner.graph.order]
        tasks = {t.name: t for t in self.runner.graph.order}
        names = order if names is None else list(names)
        unknown = [n for n in names if n not in tasks]
        if unknown:
            raise KeyError(
                f"no task named {', '.join(map(repr, unknown))} in this plan runner (tasks: {', '.join(order)})"
            )
        not_measured = {n: r for n in names if (r := shortcut_refusal(tasks[n])) is not None}
        measurable = [n for n in names if n not in not_measured]
        baselines: list[float] = []
        shortcut: dict[str, list[float]] = {n: [] for n in measurable}
        first: CostProfiler | None = None
        for _ in range(self.rounds):
            profiler = self._pass()
            first = first or profiler
            baselines.append(statistics.median(profiler.iteration_times()))
            for name in measurable:
                self.runner.enable_shortcut(name)
                try:
                    shortcut[name].append(statistics.median(self._pass().iteration_times()))
                finally:
                    self.runner.disable_shortcut(name)
        assert first is not None
        diffs = {n: [b - s for b, s in zip(baselines, shortcut[n])] for n in measurable}
        return ProfileResult(
            baseline_s=statistics.median(baselines),
            exposed_s={n: max(0.0, statistics.median(d)) for n, d in diffs.items()},
            shortcut_s={n: statistics.median(v) for n, v in shortcut.items()},
            not_measured=not_measured,
            costs=first.cost_model(order),
            warmup=self.warmup,
            iters=self.iters,
            rounds=self.rounds,
            instances=first.instances(),
            iteration_spans=[(s.start_s, s.end_s) for s in first.iterations() if not s.failed],
        )

    def _pass(self) -> CostProfiler:
        """One pass over fresh batches with a CostProfiler installed (drained to the end)."""
        runner = self.runner
        profiler = CostProfiler.for_runner(runner, self.warmup, self.iters)
        pulled = 0

        def batches() -> Iterable[Any]:
            nonlocal pulled
            for batch in self.make_batches():
                pulled += 1
                yield batch

        previous = runner.observer
        runner.observer = profiler
        try:
            for _ in runner.iterate(batches()):
                pass
        finally:
            runner.observer = previous
        if pulled < self.batches_needed:  # else the drain, with fewer tasks, would be measured
            raise ValueError(
                f"make_batches() gave {pulled} batches; a pass needs at least {self.batches_needed} "
                f"({self.warmup} warm-up + {self.iters} measured iterations)"
            )
        return profiler
