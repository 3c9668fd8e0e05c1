"""SchedulablePipeline: drives a compiled schedule over a stream of batches.

Internal iteration i pulls batch i into `ring.at(L)` (L = max lookahead) and fires every task of
lookahead k with `L - k <= i < M + L - k` (M = batches pulled so far, final once the iterator is
exhausted); that task processes batch `i - L + k`. The first `progress()` therefore absorbs L
prefill iterations, and after the iterator ends `progress()` keeps draining the in-flight batches
before raising StopIteration. Every pulled batch passes through every task exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import nvtx

from recsys_pipe.engine.context import TaskContext
from recsys_pipe.engine.deps import DependencyGraph, compile_dependencies
from recsys_pipe.engine.errors import PipelineBrokenError, TaskFailedError
from recsys_pipe.engine.executor import Executor, SequentialExecutor
from recsys_pipe.engine.schedule import Schedule
from recsys_pipe.engine.slots import BatchRing
from recsys_pipe.engine.streams import StreamPool
from recsys_pipe.engine.task import BATCH_CPU, STEP_RESULT, Task

log = logging.getLogger(__name__)


def fires(lookahead: int, max_lookahead: int, iteration: int, num_batches: int) -> bool:
    """The firing mask: does a task of this lookahead run at this internal iteration?"""
    start = max_lookahead - lookahead
    return start <= iteration < num_batches + start


class SchedulablePipeline:
    """Runs `schedule` batch-ahead over an iterator; see the module docstring for semantics."""

    def __init__(
        self,
        schedule: Schedule,
        stream_pool: StreamPool | None = None,
        executor: str | Executor = "sequential",
        *,
        state: Any = None,
    ):
        self.graph: DependencyGraph = compile_dependencies(schedule, stream_pool)
        self.schedule = schedule
        self.stream_pool = stream_pool if stream_pool is not None else StreamPool.create(schedule.stream_slots)
        self.executor = _make_executor(executor)
        self.state = state
        self.max_lookahead = schedule.max_lookahead
        self.ring = BatchRing(self.max_lookahead + 1)
        self._stage_orders = self.graph.stage_orders
        self._waits = self.graph.event_waits
        self._needs_event = {w.producer for waits in self._waits.values() for w in waits}
        self._active_cache: dict[tuple[bool, ...], tuple[tuple[Task, ...], ...]] = {}
        self._iterator: Iterator | None = None
        self._iteration = 0
        self._pulled = 0
        self._exhausted = False
        self._seeded = False
        self._broken: str | None = None
        self._closed = False
        for task in self.graph.order:
            task.init(TaskContext(task, None, 0, self.ring, self.stream_pool, self.state))

    # -- driving --------------------------------------------------------------------------------

    def progress(self, batch_iter: Iterable) -> Any:
        """Run internal iterations until one batch completes; return its `step_result`.

        Raises StopIteration once the iterator is exhausted and every in-flight batch drained.
        Passing a different iterator object starts over with it (in-flight batches of the old
        one are dropped, with a warning: they were only prepared, never trained).
        """
        self._check_usable()
        if batch_iter is not self._iterator:
            self._reset(batch_iter)
        while True:
            if self._exhausted and self.in_flight == 0:
                raise StopIteration
            completed, result = self._run_iteration(pull=True)
            if completed:
                return result

    def seed_first_batch(self, batch_iter: Iterable, slot_values: Mapping[str, Any]) -> None:
        """Start over with `batch_iter`, whose first batch the caller already pulled and began
        preparing (e.g. to run a model rewrite on it).

        `slot_values` (at least `batch_cpu`) go into that batch's store at the deepest
        lookahead, and the first iteration pulls nothing, so the batch is trained like any
        other and none is lost. Tasks see the values already there and can skip work done.
        """
        self._check_usable()
        if BATCH_CPU not in slot_values:
            raise ValueError(f"seed_first_batch needs '{BATCH_CPU}' among the slot values")
        self._reset(batch_iter)
        store = self.ring.at(self.max_lookahead)
        for name, value in slot_values.items():
            store.set(name, value)
        self._pulled = 1
        self._seeded = True

    def step(self, batch: Any) -> Any:
        """Push one batch and run one internal iteration; return the `step_result` of the batch
        that completed in it (None while the pipeline fills). Call `drain()` after the last batch."""
        self._check_usable()
        if self._iterator is not _PUSH:
            self._reset(_PUSH)
        self.ring.at(self.max_lookahead).set(BATCH_CPU, batch)
        self._pulled += 1
        return self._run_iteration(pull=False)[1]

    def drain(self) -> list[Any]:
        """After `step()` calls: finish every in-flight batch, return their results in order."""
        self._check_usable()
        self._exhausted = True
        results = []
        while self.in_flight:
            completed, result = self._run_iteration(pull=False)
            if completed:
                results.append(result)
        return results

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.executor.shutdown()

    def __enter__(self) -> SchedulablePipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    @property
    def in_flight(self) -> int:
        """Batches pulled but not yet completed."""
        completed = min(self._pulled, max(0, self._iteration - self.max_lookahead))
        return self._pulled - completed

    # -- internals ------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise PipelineBrokenError("this pipeline was shut down; build a new one")
        if self._broken is not None:
            raise PipelineBrokenError(
                f"this pipeline stopped after a failure ({self._broken}); the failed iteration was left "
                "half done, so it will not continue. Build a new pipeline (and restore from a checkpoint)."
            )

    def _reset(self, batch_iter: Any) -> None:
        if self.in_flight > 0:
            log.warning(
                "new batch iterator: dropping %d in-flight batch(es) of the previous one that "
                "were prepared but not trained",
                self.in_flight,
            )
        self._iterator = batch_iter
        self._iteration = 0
        self._pulled = 0
        self._exhausted = False
        self._seeded = False
        self.ring.clear()

    def _run_iteration(self, pull: bool) -> tuple[bool, Any]:
        i = self._iteration
        L = self.max_lookahead
        if self._seeded:  # the first batch was pulled by seed_first_batch
            self._seeded = False
        elif pull and not self._exhausted:
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._exhausted = True
            else:
                self.ring.at(L).set(BATCH_CPU, batch)
                self._pulled += 1
        try:
            for stage_tasks in self._active(i):
                if stage_tasks:
                    self.executor.execute(stage_tasks, lambda task: self._run_task(task, i), self.graph)
        except BaseException as exc:
            self._broken = str(exc) if isinstance(exc, TaskFailedError) else f"{type(exc).__name__} in iteration {i}"
            raise
        completed = 0 <= i - L < self._pulled
        result = self.ring.at(0).get(STEP_RESULT) if completed else None
        self.ring.advance()
        self._iteration = i + 1
        return completed, result

    def _active(self, i: int) -> tuple[tuple[Task, ...], ...]:
        L, m = self.max_lookahead, self._pulled
        key = tuple(fires(k, L, i, m) for k in range(L + 1))
        active = self._active_cache.get(key)
        if active is None:
            active = tuple(tuple(t for t in order if key[t.lookahead]) for order in self._stage_orders)
            self._active_cache[key] = active
        return active

    def _run_task(self, task: Task, i: int) -> None:
        pool = self.stream_pool
        ring = self.ring
        batch_index = i - self.max_lookahead + task.lookahead
        try:
            for wait in self._waits[task.name]:
                event = ring.at(wait.slot_offset).event(wait.producer)
                if event is None:  # producer has not run yet (prefill): order after its stream
                    pool.wait_stream(task.stream, wait.producer_stream)
                else:
                    pool.wait_event(task.stream, event)
            ctx = TaskContext(task, batch_index, i, ring, pool, self.state)
            with pool.use(task.stream, (task.name, batch_index)):
                nvtx.push_range(task.label)
                try:
                    task.run(ctx)
                finally:
                    nvtx.pop_range()
            if task.name in self._needs_event:  # after all of the task's work on its stream
                ring.at(task.lookahead).record_event(task.name, pool.record_event(task.stream))
        except Exception as exc:
            raise TaskFailedError(task.name, batch_index, i) from exc


class _PushMode:
    """Marker iterator for `step()`: batches arrive one by one from the caller."""

    def __repr__(self) -> str:
        return "<push>"


_PUSH = _PushMode()


def _make_executor(executor: str | Executor) -> Executor:
    if executor == "sequential":
        return SequentialExecutor()
    if executor == "threaded":
        from recsys_pipe.engine.threaded import ThreadedExecutor

        return ThreadedExecutor()
    if isinstance(executor, str):
        raise ValueError(f"unknown executor {executor!r}: use 'sequential', 'threaded' or an executor object")
    if not hasattr(executor, "execute"):
        raise TypeError(f"executor {executor!r} has no execute(tasks, run, graph) method")
    return executor
