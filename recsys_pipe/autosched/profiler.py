"""CostProfiler: measure what each task of a running plan runner costs, as the simulator's input.

An observer on the plan runner (the engine's `SpanRecorder`, extended): after `warmup` internal
iterations it records every task instance of the next `iters` iterations, then records nothing
more. Per instance:

- host time: `time.perf_counter()` around `task.run` on the thread that runs it;
- device time (plans on CUDA streams): two timing events recorded on the task's stream, one
  before and one after its work (the hooks run inside the task's stream context). They are read
  after the run, once (`instances()` waits for the device a single time): a task is never
  followed by a synchronize, so measuring does not serialise the streams. The device span is
  the stream time between the two events: the task's kernels plus any gap where the stream
  waited for the host to launch them.
- its thread id (as the executor names it), stream, lookahead, batch, iteration and `nccl` flag.

`cost_model()` reduces the instances to one `TaskCost` per task (medians and p10/p90), written
as `costs.json` and read back by `simulate` and `recsys-plan costs=...`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from recsys_pipe.autosched.costs import CostModel, TaskCost
from recsys_pipe.engine import PlanRunner, SpanRecorder, Task

__all__ = ["CostProfiler", "EventTimer", "TaskInstance", "threads_of"]

#: thread id of tasks run by the sequential executor (the simulator's name for it, too)
MAIN_THREAD = "main"
_WORKER_PREFIX = "recsys_pipe:"


class EventTimer(Protocol):
    """Device timing events (the engine's `CudaTimer`; tests use a recording stand-in).

    `event()` returns an object with `record()` (on the current stream) and
    `elapsed_time(later) -> ms`; `anchor()` returns `(event, host_time)`, an event known to
    have completed at `time.perf_counter()` `host_time`; `synchronize()` waits for every event.
    """

    def event(self) -> Any:
        """A fresh timing event, not yet recorded."""

    def anchor(self) -> tuple[Any, float]:
        """`(event, host_s)`: an event that completed at host time `host_s` (`time.perf_counter()`)."""

    def synchronize(self) -> None:
        """Wait until every recorded event has completed."""


@dataclass(frozen=True)
class TaskInstance:
    """One measured run of one task. Times are `time.perf_counter()` seconds; the device span
    (None without device timing) is on the same clock, through the timer's anchor."""

    task: str
    batch: int
    iteration: int
    thread: str
    stream: str
    lookahead: int
    nccl: bool
    start_s: float
    end_s: float
    device_start_s: float | None = None
    device_end_s: float | None = None

    @property
    def cpu_s(self) -> float:
        """Host seconds the task's call took on its thread."""
        return self.end_s - self.start_s

    @property
    def device_s(self) -> float:
        """Device seconds between the task's start and end events on its stream (0.0 without device timing)."""
        if self.device_start_s is None or self.device_end_s is None:
            return 0.0
        return self.device_end_s - self.device_start_s


def threads_of(runner: PlanRunner) -> dict[str, str]:
    """task name -> the thread id the runner's executor runs it on ("main" when sequential)."""
    thread_id = getattr(runner.executor, "thread_id", None)
    if thread_id is None:
        return {t.name: MAIN_THREAD for t in runner.graph.order}
    return {t.name: str(thread_id(t)) for t in runner.graph.order}


class CostProfiler(SpanRecorder):
    """Records task instances of `iters` iterations after `warmup` ones (see the module doc).

    Install it as the plan runner's observer (`CostProfiler.for_runner` fills in the thread ids
    and the device timer from the runner). Iterations are counted from the first one it
    observes, the prefill included: use `warmup` >= the plan's max lookahead so that only
    steady-state iterations are measured (`TaskProfiler` does).

    Args:
        warmup: iterations observed before measuring.
        iters: iterations measured.
        thread_of: task name -> thread id for the records; default: the OS thread's name
            (`recsys_pipe:<id>` becomes `<id>`, the main thread `main`).
        timer: device timing events (`StreamPool.timer()`); None: host times only.
    """

    def __init__(
        self,
        warmup: int = 3,
        iters: int = 20,
        *,
        thread_of: Mapping[str, str] | None = None,
        timer: EventTimer | None = None,
    ):
        if warmup < 0 or iters < 1:
            raise ValueError(f"need warmup >= 0 and iters >= 1, got warmup={warmup}, iters={iters}")
        super().__init__()
        self.warmup, self.iters = warmup, iters
        self.thread_of = dict(thread_of) if thread_of is not None else None
        self.timer = timer
        self._seen = 0
        self._measuring = False
        self._measured = 0
        self._tasks: dict[str, Task] = {}
        self._events: dict[tuple[str, int], list[Any]] = {}
        self._anchor: tuple[Any, float] | None = None
        self._instances: tuple[int, list[TaskInstance]] | None = None  # (spans seen, instances)

    @classmethod
    def for_runner(cls, runner: PlanRunner, warmup: int = 3, iters: int = 20) -> CostProfiler:
        """A profiler with the runner's thread ids and, on CUDA streams, device timing."""
        return cls(warmup, iters, thread_of=threads_of(runner), timer=runner.stream_pool.timer())

    @property
    def done(self) -> bool:
        """All `iters` iterations were measured."""
        return self._measured >= self.iters

    @property
    def measured_iterations(self) -> int:
        """How many iterations have been measured so far (the warm-up ones not counted)."""
        return self._measured

    # -- hooks ------------------------------------------------------------------------------------

    def iteration_started(self, iteration: int) -> None:
        n = self._seen
        self._seen += 1
        self._measuring = self.warmup <= n < self.warmup + self.iters
        if self._measuring:
            if self.timer is not None and self._anchor is None:
                self._anchor = self.timer.anchor()  # one device wait, before the first measured task
            super().iteration_started(iteration)

    def task_started(self, task: Task, batch_index: int, iteration: int) -> None:
        if not self._measuring:
            return
        self._tasks[task.name] = task
        if self.timer is not None:  # before the host stamp: the host span excludes the record call
            start = self.timer.event()
            start.record()
            self._events[task.name, iteration] = [start, None]
        super().task_started(task, batch_index, iteration)

    def task_finished(self, task: Task, batch_index: int, iteration: int, failed: bool) -> None:
        if not self._measuring:
            return
        super().task_finished(task, batch_index, iteration, failed)
        if self.timer is not None:
            end = self.timer.event()
            end.record()
            self._events[task.name, iteration][1] = end

    def iteration_finished(self, iteration: int, failed: bool) -> None:
        if self._measuring:
            super().iteration_finished(iteration, failed)
            self._measured += 1
            self._measuring = False

    # -- results ----------------------------------------------------------------------------------

    def instances(self) -> list[TaskInstance]:
        """Every measured task instance, in start order (waits for the device once)."""
        spans = self.spans()
        if self._instances is not None and self._instances[0] == len(spans):
            return self._instances[1]
        device: dict[tuple[str, int], tuple[float, float]] = {}
        if self.timer is not None and self._events:
            self.timer.synchronize()
            assert self._anchor is not None
            anchor, host = self._anchor
            for key, (start, end) in self._events.items():
                if end is not None:
                    device[key] = (host + anchor.elapsed_time(start) / 1e3, host + anchor.elapsed_time(end) / 1e3)
        out = []
        for span in sorted(spans, key=lambda s: s.start_s):
            if span.failed:
                continue
            task = self._tasks[span.task]
            d_start, d_end = device.get((span.task, span.iteration), (None, None))
            out.append(
                TaskInstance(
                    task=span.task,
                    batch=span.batch_index,
                    iteration=span.iteration,
                    thread=self._thread(span.task, span.thread),
                    stream=task.stream,
                    lookahead=task.lookahead,
                    nccl=task.nccl,
                    start_s=span.start_s,
                    end_s=span.end_s,
                    device_start_s=d_start,
                    device_end_s=d_end,
                )
            )
        self._instances = (len(spans), out)
        return out

    def iteration_times(self) -> list[float]:
        """Duration of every measured iteration, in seconds."""
        return [s.duration_s for s in self.iterations() if not s.failed]

    def outside_times(self) -> list[float]:
        """Per measured iteration, the time before its first task starts and after its last task
        ends: fetching the batch (`next()` on the data iterator), rotating the ring (releasing
        the trained batch's values), the executor's barrier. It lies on the calling thread,
        in series with every task, and a plan's tasks cannot overlap it."""
        by_iteration: dict[int, tuple[float, float]] = {}
        for inst in self.instances():
            lo, hi = by_iteration.get(inst.iteration, (inst.start_s, inst.end_s))
            by_iteration[inst.iteration] = (min(lo, inst.start_s), max(hi, inst.end_s))
        out = []
        for it in self.iterations():
            if not it.failed and it.iteration in by_iteration:
                first, last = by_iteration[it.iteration]
                out.append((first - it.start_s) + (it.end_s - last))
        return out

    def cost_model(self, order: Sequence[str] | None = None, meta: Mapping[str, Any] | None = None) -> CostModel:
        """One `TaskCost` per task: median host and device time with p10/p90, their means, and
        how it ran.

        `order`: task names in the order to list them (default: first start); `meta` goes into
        the cost model's `meta` with `warmup`, `iters` and the median and mean iteration time
        (`iteration_s`, `iteration_mean_s`). The time outside tasks (`outside_times`) becomes
        the model's `outside_tasks_s` (median) and `outside_tasks_mean_s`.
        """
        by_task: dict[str, list[TaskInstance]] = {}
        for inst in self.instances():
            by_task.setdefault(inst.task, []).append(inst)
        names = [n for n in order if n in by_task] if order is not None else list(by_task)
        names += [n for n in by_task if n not in names]
        tasks = {}
        for name in names:
            runs = by_task[name]
            cpu = np.percentile([r.cpu_s for r in runs], [10, 50, 90])
            timed = [r.device_s for r in runs if r.device_start_s is not None]
            dev = np.percentile(timed, [10, 50, 90]) if timed else None
            first = runs[0]
            tasks[name] = TaskCost(
                cpu_s=float(cpu[1]),
                device_s=float(dev[1]) if dev is not None else 0.0,
                cpu_mean_s=float(np.mean([r.cpu_s for r in runs])),
                device_mean_s=float(np.mean(timed)) if timed else None,
                cpu_p10_s=float(cpu[0]),
                cpu_p90_s=float(cpu[2]),
                device_p10_s=float(dev[0]) if dev is not None else None,
                device_p90_s=float(dev[2]) if dev is not None else None,
                stream=first.stream,
                thread=first.thread,
                lookahead=first.lookahead,
                nccl=first.nccl,
                samples=len(runs),
            )
        times, outside = self.iteration_times(), self.outside_times()
        info = {
            "warmup": self.warmup,
            "iters": self._measured,
            "iteration_s": float(np.median(times)) if times else None,
            "iteration_mean_s": float(np.mean(times)) if times else None,
            "device_timing": self.timer is not None,
        }
        return CostModel(
            tasks,
            {**info, **(meta or {})},
            outside_tasks_s=float(np.median(outside)) if outside else 0.0,
            outside_tasks_mean_s=float(np.mean(outside)) if outside else None,
        )

    def _thread(self, task: str, os_thread: str) -> str:
        if self.thread_of is not None and task in self.thread_of:
            return self.thread_of[task]
        if os_thread.startswith(_WORKER_PREFIX):
            return os_thread[len(_WORKER_PREFIX) :]
        return MAIN_THREAD if os_thread == threading.main_thread().name else os_thread
