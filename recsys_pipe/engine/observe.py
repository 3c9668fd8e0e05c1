"""Watching a plan runner: hooks around iterations and tasks, and a recorder of task spans.

A profiler or a benchmark installs a `TaskObserver` on a `PlanRunner` (constructor
keyword `observer=` or the settable `runner.observer` property) instead of wrapping task
functions. Without an observer the engine pays one branch per task.

Where the hooks run matters for what they can measure:

- `iteration_started` / `iteration_finished` run on the thread that called `progress()`,
  before the iteration's first task and after its last one (also after a failure).
- `tasks_done` runs on that thread too, once every task of the iteration returned and before
  the ring rotates. Rotating drops the trained batch's slot values (device batch, torchrec
  context, model outputs and their autograd graph), which any training loop pays when it lets
  go of a batch: the time from `tasks_done` to `iteration_finished` is that release, so a
  benchmark can report it apart from the engine's own cost. Not called when a task failed.
- `task_started` / `task_finished` run on the thread that runs the task, inside the task's
  stream context and NVTX range, immediately around `task.run(ctx)`. On CUDA the current
  stream is the task's stream, so an observer can record CUDA events there to time the
  task's device work (see `SpanRecorder`).

Hooks may be called from several threads at once (threaded executor) and must be thread-safe.
An exception raised by a task hook fails that task like an exception from the task itself.
Iteration numbers are the plan runner's internal iterations (`ctx.iter_count`), which restart at 0
when `progress()` gets a new iterator.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from recsys_pipe.engine.task import Task


class TaskObserver:
    """Base class of plan-runner observers: every hook is a no-op; override the ones you need."""

    def iteration_started(self, iteration: int) -> None:
        """The plan runner is about to run internal iteration `iteration`."""

    def task_started(self, task: Task, batch_index: int, iteration: int) -> None:
        """`task` is about to run on batch `batch_index` (on its thread, in its stream context)."""

    def task_finished(self, task: Task, batch_index: int, iteration: int, failed: bool) -> None:
        """`task.run` returned (`failed=False`) or raised (`failed=True`)."""

    def tasks_done(self, iteration: int) -> None:
        """Every task of `iteration` returned; the ring rotates next (see the module docstring)."""

    def iteration_finished(self, iteration: int, failed: bool) -> None:
        """Every task of `iteration` has stopped; `failed` when one of them raised."""


class TaskScopes(TaskObserver):
    """An observer that holds a context open around each task it chooses (a dispatch mode, a
    profiler range), entered and left on the task's own thread: subclasses say which context in
    `task_scope`. A thread runs one task at a time, so the open context is kept per thread, where
    code running inside the task finds it (`open_scope`)."""

    def __init__(self) -> None:
        self._open = threading.local()

    def task_scope(self, task: Task, batch_index: int) -> AbstractContextManager | None:
        """The context to hold open around `task` on `batch_index` (None: none)."""
        raise NotImplementedError

    def open_scope(self) -> AbstractContextManager | None:
        """The context open around the task this thread is running (None: none)."""
        return getattr(self._open, "scope", None)

    def task_started(self, task: Task, batch_index: int, iteration: int) -> None:
        scope = self.task_scope(task, batch_index)
        if scope is not None:
            scope.__enter__()
        self._open.scope = scope

    def task_finished(self, task: Task, batch_index: int, iteration: int, failed: bool) -> None:
        scope = self.open_scope()
        if scope is not None:
            self._open.scope = None
            scope.__exit__(None, None, None)


@dataclass(frozen=True)
class TaskSpan:
    """One task invocation as seen by `SpanRecorder`: host times from `time.perf_counter()`."""

    task: str
    batch_index: int
    iteration: int
    thread: str  # `threading.current_thread().name` of the thread that ran it
    start_s: float
    end_s: float
    failed: bool

    @property
    def duration_s(self) -> float:
        """Host seconds from the task's start to its end."""
        return self.end_s - self.start_s


@dataclass(frozen=True)
class IterationSpan:
    """One internal iteration as seen by `SpanRecorder`, on the thread that called `progress()`."""

    iteration: int
    start_s: float
    end_s: float
    failed: bool

    @property
    def duration_s(self) -> float:
        """Host seconds from the iteration's start to its end."""
        return self.end_s - self.start_s


class SpanRecorder(TaskObserver):
    """Records a `TaskSpan` per task invocation and an `IterationSpan` per internal iteration.

    Thread-safe. To add device timing, subclass it and extend `task_started` / `task_finished`
    (calling `super()`): they run inside the task's stream context, so for example

        def task_started(self, task, batch_index, iteration):
            super().task_started(task, batch_index, iteration)
            self.events[task.name, iteration] = [torch.cuda.Event(enable_timing=True)]
            self.events[task.name, iteration][0].record()  # on the task's stream

    records an event on the task's stream before its work; a matching event recorded in
    `task_finished` and read after a `torch.cuda.synchronize()` gives its device time.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[TaskSpan] = []
        self._iterations: list[IterationSpan] = []
        # A task never overlaps itself (one invocation per iteration, iterations in sequence),
        # so its name identifies its open invocation.
        self._task_start: dict[str, float] = {}
        self._iteration_start = 0.0

    # -- hooks ------------------------------------------------------------------------------------

    def iteration_started(self, iteration: int) -> None:
        self._iteration_start = time.perf_counter()

    def task_started(self, task: Task, batch_index: int, iteration: int) -> None:
        self._task_start[task.name] = time.perf_counter()

    def task_finished(self, task: Task, batch_index: int, iteration: int, failed: bool) -> None:
        end = time.perf_counter()
        span = TaskSpan(
            task.name,
            batch_index,
            iteration,
            threading.current_thread().name,
            self._task_start.pop(task.name),
            end,
            failed,
        )
        with self._lock:
            self._spans.append(span)

    def iteration_finished(self, iteration: int, failed: bool) -> None:
        span = IterationSpan(iteration, self._iteration_start, time.perf_counter(), failed)
        with self._lock:
            self._iterations.append(span)

    # -- results ----------------------------------------------------------------------------------

    def spans(self, first: int = 0, stop: int | None = None) -> list[TaskSpan]:
        """Task spans of iterations `first <= iteration < stop` (all by default), in the order
        the tasks finished."""
        with self._lock:
            spans = list(self._spans)
        return [s for s in spans if s.iteration >= first and (stop is None or s.iteration < stop)]

    def iterations(self, first: int = 0, stop: int | None = None) -> list[IterationSpan]:
        """Iteration spans of iterations `first <= iteration < stop`, in order."""
        with self._lock:
            spans = list(self._iterations)
        return [s for s in spans if s.iteration >= first and (stop is None or s.iteration < stop)]

    def clear(self) -> None:
        """Forget everything recorded so far (e.g. the warm-up, or before a new iterator)."""
        with self._lock:
            self._spans.clear()
            self._iterations.clear()


class RecordFunctionRanges(TaskScopes):
    """Opens a `torch.profiler.record_function` range around every task, named by `task.label`
    (args: the batch index), so a torch.profiler trace shows each task on its thread.

    Install it only while a torch profiler is recording (the ranges cost a few µs per task
    then, and nothing when it is not installed). Worker threads are recorded only by a
    profiler that profiles all threads (`torch.profiler._ExperimentalConfig(profile_all_threads=True)`).
    """

    def task_scope(self, task: Task, batch_index: int) -> AbstractContextManager:
        return torch.autograd.profiler.record_function(task.label, f"batch={batch_index}")
