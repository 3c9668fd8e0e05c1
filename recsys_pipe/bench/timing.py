"""The timed window the training benchmarks share (`recsys_pipe.bench.train`,
`recsys_pipe.bench.shuffle`): a window opened after a barrier and closed after the last timed
step, the engine observer that opens and closes it from the plan runner's own hooks and splits the
window into task bodies, engine, release and loop time, Python's garbage-collection pauses, and
the peak memory of one run. `recsys_pipe.bench.train`'s module docstring says what each figure
means.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from recsys_pipe.engine import Task, TaskObserver

__all__ = ["GC", "TAIL", "GcPauses", "PeakMemory", "StepTimer", "Window", "observer_cost_us"]

TAIL = 2  # untimed steps after the window: the largest lookahead, so the window never drains


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


class GcPauses:
    """Python's cyclic garbage collections while `active`, from `gc.callbacks` (the interpreter's
    own hook): `(generation, start, end)` per collection. Any Python training loop pays them,
    at a rate set by how many objects the step allocates."""

    def __init__(self) -> None:
        self.active = False
        self.pauses: list[tuple[int, float, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.active:
            self.pauses.append((info["generation"], self._start, time.perf_counter()))

    def reset(self) -> None:
        """Forget the recorded pauses."""
        self.pauses = []


GC = GcPauses()
gc.callbacks.append(GC)


class PeakMemory:
    """Peak memory of one run in this process (`recsys_pipe.bench.train`'s module docstring says how).

    `/proc/self/clear_refs` "5" resets VmHWM to the current RSS (Linux >= 4.0, own process);
    `malloc_trim(0)` is glibc's, called through ctypes because no library exposes it. If either
    is missing the RSS figures are None and the report says so.
    """

    def __init__(self, device: torch.device):
        self.device = device
        libc_name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(libc_name) if libc_name else None
        self._trim = getattr(libc, "malloc_trim", None)
        self.problem: str | None = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            _status_kib("VmHWM")
        except (OSError, KeyError) as exc:
            self.problem = f"cannot reset the RSS high-water mark here ({exc}); peak RSS not measured"
        self.base_kib = 0

    def start(self) -> None:
        """Collect the previous run's garbage, return it to the OS and reset the peak marks."""
        gc.collect()
        if self._trim is not None:
            self._trim(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.problem is None:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base_kib = _status_kib("VmRSS")

    def stop(self) -> dict[str, float | None]:
        """The run's peak RSS and its growth (MiB; None where not measurable), and on CUDA the device peaks."""
        out: dict[str, float | None] = {"peak_rss_mib": None, "rss_growth_mib": None}
        if self.problem is None:
            peak = _status_kib("VmHWM")
            out = {"peak_rss_mib": peak / 1024, "rss_growth_mib": (peak - self.base_kib) / 1024}
        if self.device.type == "cuda":
            out["cuda_peak_allocated_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            out["cuda_peak_reserved_mib"] = torch.cuda.max_memory_reserved(self.device) / 2**20
        return out


class Window:
    """The timed window of one run: opened after a barrier, closed after the last timed step
    (on CUDA both after a device synchronize, so queued work is inside the window)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.t0 = self.t1 = None
        self.cpu0 = self.cpu1 = 0.0
        self.jiffies0 = self.jiffies1 = (0, 0)
        self.pauses: list[tuple[int, float, float]] = []  # garbage collections in the window

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def open(self) -> None:
        """Open the window after a barrier (and a device synchronize on CUDA)."""
        self._sync()
        dist.barrier()
        self.jiffies0 = _cpu_jiffies()
        GC.reset()
        GC.active = True
        self.cpu0 = time.process_time()
        self.t0 = time.perf_counter()

    def close(self) -> None:
        """Close the window (after a device synchronize on CUDA)."""
        self._sync()
        self.t1 = time.perf_counter()
        self.cpu1 = time.process_time()
        GC.active = False
        self.pauses = list(GC.pauses)
        self.jiffies1 = _cpu_jiffies()

    def figures(self) -> dict[str, float]:
        """Wall and CPU seconds of the window, the machine's busy share, and garbage-collection time and counts."""
        if self.t1 is None:
            raise RuntimeError("the run ended before its timed window closed")
        busy, total = (b - a for a, b in zip(self.jiffies0, self.jiffies1))
        gc_s = [0.0, 0.0, 0.0]
        for generation, start, end in self.pauses:
            gc_s[generation] += end - start
        return {
            "seconds": self.t1 - self.t0,
            "cpu_seconds": self.cpu1 - self.cpu0,
            "machine_busy": busy / total if total else 0.0,
            "gc_seconds": gc_s,  # per generation
            "gc_count": [sum(1 for p in self.pauses if p[0] == g) for g in range(3)],
        }


class StepTimer(TaskObserver):
    """Times a window of internal iterations `[first, stop)` of a plan runner from its
    hooks: opens `window` when iteration `first - 1` finishes and closes it when `stop - 1`
    finishes; records every task span and the iteration boundaries in between. Cheap on
    purpose (a clock read and a dict or list write per hook): its cost lands in the engine
    figure."""

    def __init__(self, window: Window, first: int, stop: int):
        self.window, self.first, self.stop = window, first, stop
        self.started: dict[int, float] = {}
        self.done: dict[int, float] = {}
        self.finished: dict[int, float] = {}
        self.spans: list[tuple[int, str, str, float, float]] = []  # iteration, task, thread, start, end
        self._open: dict[str, float] = {}  # a task never overlaps itself: its name is its key

    def iteration_started(self, iteration: int) -> None:
        self.started[iteration] = time.perf_counter()

    def task_started(self, task: Task, batch_index: int, iteration: int) -> None:
        self._open[task.name] = time.perf_counter()

    def task_finished(self, task: Task, batch_index: int, iteration: int, failed: bool) -> None:
        end = time.perf_counter()
        self.spans.append((iteration, task.name, threading.current_thread().name, self._open.pop(task.name), end))

    def tasks_done(self, iteration: int) -> None:
        self.done[iteration] = time.perf_counter()

    def iteration_finished(self, iteration: int, failed: bool) -> None:
        self.finished[iteration] = time.perf_counter()
        if iteration == self.first - 1:
            self.window.open()
        elif iteration == self.stop - 1:
            self.window.close()

    def breakdown(self) -> dict[str, Any]:
        """Seconds of the window: task bodies (union over threads), engine, release, loop; and
        task-body seconds per task and per thread."""
        by_iteration: dict[int, list[tuple[float, float]]] = {}
        per_task: dict[str, float] = {}
        per_thread: dict[str, float] = {}
        thread_of: dict[str, str] = {}
        for iteration, task, thread, start, end in self.spans:
            if self.first <= iteration < self.stop:
                by_iteration.setdefault(iteration, []).append((start, end, task))
                per_task[task] = per_task.get(task, 0.0) + end - start
                per_thread[thread] = per_thread.get(thread, 0.0) + end - start
                thread_of[task] = thread
        pauses = [(start, end, None) for _, start, end in self.window.pauses]  # garbage collections
        busy = engine = release = loop = gc_outside = 0.0
        gaps: dict[str, float] = {}  # engine time by where it falls: before which task, or at the end
        previous_end = self.window.t0
        for i in range(self.first, self.stop):
            started, done, finished = self.started[i], self.done[i], self.finished[i]
            tasks = by_iteration.get(i, [])
            union = _union_length(tasks, started, done)
            covered = _union_length(tasks + pauses, started, done)  # task bodies or collections
            busy += union
            engine += done - started - covered
            _attribute_gaps(tasks + pauses, started, done, gaps)
            in_release = _union_length(pauses, done, finished)
            in_loop = _union_length(pauses, previous_end, started)
            release += finished - done - in_release
            loop += started - previous_end - in_loop
            gc_outside += covered - union + in_release + in_loop
            previous_end = finished
        return {
            "busy_s": busy,
            "engine_s": engine,
            "release_s": release,
            "loop_s": loop,
            "gc_outside_tasks_s": gc_outside,
            "per_task_s": per_task,
            "per_thread_s": per_thread,
            "thread_of": thread_of,
            "gaps_s": gaps,
        }


def _union_length(spans: list[tuple[float, float, str | None]], lo: float, hi: float) -> float:
    """Length of the union of the `(start, end, task)` spans, clipped to [lo, hi]."""
    total, reach = 0.0, lo
    for start, end, _ in sorted(spans):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


def _attribute_gaps(spans: list[tuple[float, float, str | None]], lo: float, hi: float, gaps: dict[str, float]) -> None:
    """Add the gaps of the spans' union within [lo, hi] to `gaps`, keyed by the next task to
    start ("before <task>") or "after the last task" (the executor's join). Spans without a
    task (garbage collections) cover time but name no position."""
    reach, pending = lo, 0.0
    for start, end, task in sorted(spans, key=lambda span: span[:2]):
        if end <= lo or start >= hi:  # e.g. a collection in another iteration
            continue
        start, end = max(start, lo), min(end, hi)
        if start > reach:
            pending += start - reach
        if task is not None and pending:
            gaps[f"before {task}"] = gaps.get(f"before {task}", 0.0) + pending
            pending = 0.0
        reach = max(reach, end)
    pending += max(0.0, hi - reach)
    if pending:
        gaps["after the last task"] = gaps.get("after the last task", 0.0) + pending


def observer_cost_us(tasks: int, calls: int = 20000) -> float:
    """The StepTimer's own cost per step, its hooks timed alone on this thread (µs)."""

    class _Named:
        def __init__(self, name: str):
            self.name = name

    timer = StepTimer(Window(torch.device("cpu")), 10**9, 10**9 + 1)  # never opens the window
    named = [_Named(f"t{k}") for k in range(tasks)]
    start = time.perf_counter()
    for i in range(calls // tasks):
        timer.iteration_started(i)
        for task in named:
            timer.task_started(task, i, i)  # type: ignore[arg-type]
            timer.task_finished(task, i, i, False)  # type: ignore[arg-type]
        timer.tasks_done(i)
        timer.iteration_finished(i, False)
    return (time.perf_counter() - start) / (calls // tasks) * 1e6
