"""PlanRunner: runs one plan (a compiled task graph) over a stream of batches.

Internal iteration i pulls batch i into `ring.at(L)` (L = max lookahead) and fires every task of
lookahead k with `L - k <= i < M + L - k` (M = batches pulled so far, final once the iterator is
exhausted); that task processes batch `i - L + k`. The first `progress()` therefore absorbs L
prefill iterations, and after the iterator ends `progress()` keeps draining the in-flight batches
before raising StopIteration. Every pulled batch passes through every task exactly once.

What a task costs on real streams, and how it is kept small:

* its event waits, minus those stream order already implies in the steady state
  (`recsys_pipe.engine.stream_order`);
* its stream made current (`StreamPool.enter`) only when the thread's current stream is another:
  consecutive tasks of one thread on one stream switch once per iteration, tasks on the stream
  the caller already uses not at all; the caller's stream is restored when the iteration ends;
* its completion event, where another stream waits on it, recorded into the event object its
  ring position already holds (`SlotStore.spare_event`) rather than a new one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import nvtx

from recsys_pipe.engine.context import TaskContext
from recsys_pipe.engine.deps import DependencyGraph, compile_dependencies
from recsys_pipe.engine.errors import PlanRunnerBrokenError, Problem, TaskFailedError, TaskGraphValidationError
from recsys_pipe.engine.executor import Executor, SequentialExecutor
from recsys_pipe.engine.observe import TaskObserver
from recsys_pipe.engine.shortcut import ShortcutRun, shortcut_refusal
from recsys_pipe.engine.slots import BatchRing
from recsys_pipe.engine.stream_order import ImpliedWaits, implied_waits
from recsys_pipe.engine.streams import StreamPool
from recsys_pipe.engine.task import BATCH_CPU, STEP_RESULT, Task
from recsys_pipe.engine.task_graph import TaskGraph

log = logging.getLogger(__name__)


def fires(lookahead: int, max_lookahead: int, iteration: int, num_batches: int) -> bool:
    """The firing mask: does a task of this lookahead run at this internal iteration?

    Args:
        lookahead: the task's lookahead k.
        max_lookahead: the task graph's largest lookahead L.
        iteration: the internal iteration i (0 = the first, prefill included).
        num_batches: M, the batches pulled from the iterator so far.

    Returns:
        Whether `L - k <= i < M + L - k`; the task then processes batch `i - L + k`."""
    start = max_lookahead - lookahead
    return start <= iteration < num_batches + start


class _TaskRecord:
    """What running one task needs, resolved once per plan runner so the per-task path does no
    lookups: its event waits, whether it records an event, its NVTX label, and what runs it
    (`task.run`, or a `ShortcutRun` while a shortcut is enabled)."""

    __slots__ = ("task", "run", "name", "lookahead", "stream", "label", "waits", "steady_waits", "records_event")

    def __init__(self, task: Task, graph: DependencyGraph, needs_event: set[str], implied: ImpliedWaits):
        self.task = task
        self.run: Callable[[TaskContext], Any] = task.run
        self.name = task.name
        self.lookahead = task.lookahead
        self.stream = task.stream
        self.label = task.label
        waits = graph.event_waits[task.name]
        self.waits = tuple((w.slot_offset, w.producer, w.producer_stream) for w in waits)
        #: the waits of the steady state: those stream order does not already imply
        self.steady_waits = tuple(self.waits[i] for i in implied.kept(graph, task.name))
        self.records_event = task.name in needs_event


class _ThreadStream(threading.local):
    """Per thread: the stream the plan runner made current there in iteration `seq`."""

    seq = -1
    stream: str | None = None


class PlanRunner:
    """Runs `task_graph` batch-ahead over an iterator; see the module docstring for semantics.

    Args:
        task_graph: the tasks and streams of one iteration: a `TaskGraph`, or its already compiled
            `DependencyGraph` (e.g. from the plan compiler), which is then not compiled again.
        stream_pool: named streams; default: no-op streams named by `task_graph.stream_slots`.
        executor: `"sequential"`, `"threaded"` or an `Executor` object.
        state: shared object every task sees as `ctx.state` (model, optimizer, ...).
        observer: a `TaskObserver` called around iterations and tasks (see `observer`).
        nvtx_ranges: wrap each task in an NVTX range named `task.label`; default: only when
            the pool has CUDA streams (where a profiler can see them).
    """

    def __init__(
        self,
        task_graph: TaskGraph | DependencyGraph,
        stream_pool: StreamPool | None = None,
        executor: str | Executor = "sequential",
        *,
        state: Any = None,
        observer: TaskObserver | None = None,
        nvtx_ranges: bool | None = None,
    ):
        if isinstance(task_graph, DependencyGraph):
            self.graph = task_graph
            _check_pool(task_graph, stream_pool)
        else:
            self.graph = compile_dependencies(task_graph, stream_pool)
        task_graph = self.graph.task_graph
        self.task_graph = task_graph
        self.stream_pool = stream_pool if stream_pool is not None else StreamPool.create(task_graph.stream_slots)
        self.executor = _make_executor(executor)
        self.state = state
        self.observer = observer
        self.max_lookahead = task_graph.max_lookahead
        self.ring = BatchRing(self.max_lookahead + 1)
        self._nvtx = self.stream_pool.is_cuda if nvtx_ranges is None else bool(nvtx_ranges)
        # No-op streams order nothing: skip event waits, records and stream scopes entirely.
        self._stream_ops = not self.stream_pool.is_noop
        self._scoped = self.stream_pool.has_scopes
        # Per task just `task.run(ctx)`: no stream work, no NVTX, no observer and no shortcut (a
        # shortcut is run through `_run_observed`, which calls `record.run`, so this path stays as is).
        self._plain_possible = not self._stream_ops and not self._nvtx
        self._plain = self._plain_possible
        needs_event = {w.producer for waits in self.graph.event_waits.values() for w in waits}
        #: the waits stream order implies in the steady state (none where streams order nothing)
        self.implied = implied_waits(self.graph) if self._stream_ops else ImpliedWaits(frozenset(), None)
        self._records = {t: _TaskRecord(t, self.graph, needs_event, self.implied) for t in self.graph.order}
        self._thread_stream = _ThreadStream()
        self._seq = 0  # iterations run, for `_ThreadStream.seq`
        # Whether the iterations since the last reset followed the schedule `implied_waits` replayed
        # (a prefill pulling one batch per iteration, then steady iterations): only then may the
        # steady state skip the implied waits.
        self._replayed = True
        self._steady = False  # the running iteration skips the implied waits
        self._group_orders = self.graph.group_orders
        self._active_cache: dict[tuple[bool, ...], tuple[tuple[Task, ...], ...]] = {}
        self._iterator: Iterator | None = None
        self._iteration = 0
        self._pulled = 0
        self._exhausted = False
        self._seeded = False
        self._broken: str | None = None
        self._closed = False
        # What tasks of the running iteration read, set before the executor starts them.
        self._running_iteration = 0
        self._running_observer: TaskObserver | None = None
        for task in self.graph.order:
            task.init(TaskContext(task, None, 0, self.ring, self.stream_pool, self.state))

    @property
    def observer(self) -> TaskObserver | None:
        """The installed `TaskObserver`, or None. Settable between `progress()` calls (None
        detaches); an iteration uses the observer installed when it started."""
        return self._observer

    @observer.setter
    def observer(self, observer: TaskObserver | None) -> None:
        if observer is not None and not isinstance(observer, TaskObserver):
            raise TypeError(f"observer must be a TaskObserver (or None), got {type(observer).__name__}")
        self._observer = observer

    # -- shortcuts ------------------------------------------------------------------------------

    def enable_shortcut(self, names: str | Iterable[str]) -> None:
        """Replay these tasks instead of running them (see `recsys_pipe.engine.shortcut`).

        The next run of each runs it for real and records what it did to its slots (and what its
        `DeclaredIO`s capture); every later run replays that. Call between `progress()` calls,
        with the same names on every rank. Raises KeyError for an unknown task and ValueError
        for a task with effects outside its slots and no `io` to replay them (nothing is
        enabled then).
        """
        records = self._named_records(names)
        refusals = [reason for r in records if (reason := shortcut_refusal(r.task)) is not None]
        if refusals:
            raise ValueError("; ".join(refusals))
        for record in records:
            if not isinstance(record.run, ShortcutRun):
                record.run = ShortcutRun(record.task)
        self._plain = False

    def disable_shortcut(self, names: str | Iterable[str]) -> None:
        """Run these tasks for real again and forget what their shortcuts recorded."""
        for record in self._named_records(names):
            record.run = record.task.run
        self._plain = self._plain_possible and not self.shortcuts

    @property
    def shortcuts(self) -> frozenset[str]:
        """Names of the tasks whose shortcut is enabled."""
        return frozenset(r.name for r in self._records.values() if isinstance(r.run, ShortcutRun))

    def _named_records(self, names: str | Iterable[str]) -> list[_TaskRecord]:
        by_name = {r.name: r for r in self._records.values()}
        names = [names] if isinstance(names, str) else list(names)
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise KeyError(
                f"no task named {', '.join(map(repr, unknown))} in this plan runner (tasks: {', '.join(by_name)})"
            )
        return [by_name[n] for n in names]

    # -- driving --------------------------------------------------------------------------------

    def iterate(self, batches: Iterable) -> Iterator[Any]:
        """Yield the `step_result` of every batch of `batches`, in order, until all are drained.

        The generator may be abandoned early (`break`): batches already in flight stay in the
        ring, and `progress()` / `iterate()` on the same iterator object continue from there.
        """
        it = iter(batches)
        while True:
            try:
                result = self.progress(it)
            except StopIteration:
                return
            yield result

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
        that completed in it (None while the plan runner fills). Call `drain()` after the last batch."""
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
        """Shut the executor down (its worker threads end); safe to call twice."""
        if not self._closed:
            self._closed = True
            self.executor.shutdown()

    def __enter__(self) -> PlanRunner:
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
            raise PlanRunnerBrokenError("this plan runner was shut down; build a new one")
        if self._broken is not None:
            raise PlanRunnerBrokenError(
                f"this plan runner stopped after a failure ({self._broken}); the failed iteration was left "
                "half done, so it will not continue. Build a new plan runner (and restore from a checkpoint)."
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
        self._replayed = True
        self.ring.clear()

    def _run_iteration(self, pull: bool) -> tuple[bool, Any]:
        i = self._iteration
        L = self.max_lookahead
        observer = self._observer
        if observer is not None:
            observer.iteration_started(i)
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
        self._running_iteration = i
        self._running_observer = observer
        try:
            if self._stream_ops:
                self._run_on_streams(i)
            else:  # `_run_on_streams` without the streams: this loop is the no-op pool's whole iteration
                for group_tasks in self._active(i):
                    if group_tasks:
                        self.executor.execute(group_tasks, self._run_task, self.graph)
        except BaseException as exc:
            self._broken = str(exc) if isinstance(exc, TaskFailedError) else f"{type(exc).__name__} in iteration {i}"
            if observer is not None:
                observer.iteration_finished(i, True)
            raise
        if observer is not None:
            observer.tasks_done(i)
        completed = 0 <= i - L < self._pulled
        result = self.ring.at(0).get(STEP_RESULT) if completed else None
        self.ring.advance()
        self._iteration = i + 1
        if observer is not None:
            observer.iteration_finished(i, False)
        return completed, result

    def _run_on_streams(self, i: int) -> None:
        """Iteration `i`'s tasks where the streams order work: first whether it skips the implied
        waits; the calling thread gets its current stream back at the end."""
        L, m = self.max_lookahead, self._pulled
        steady = L <= i < m
        if not (steady or (i < L and m == i + 1)):
            self._replayed = False  # not the replayed schedule (a short or exhausted iterator)
        start = self.implied.from_iteration
        self._steady = steady and self._replayed and start is not None and i >= start
        self._seq += 1
        local, pool = self._thread_stream, self.stream_pool
        saved = pool.current()
        local.seq, local.stream = self._seq, pool.current_name()
        entered = local.stream
        try:
            for group_tasks in self._active(i):
                if group_tasks:
                    self.executor.execute(group_tasks, self._run_task, self.graph)
        finally:
            if local.stream != entered:
                pool.restore(saved)

    def _active(self, i: int) -> tuple[tuple[Task, ...], ...]:
        """The tasks that fire at iteration `i`, per group, in topological order."""
        L, m = self.max_lookahead, self._pulled
        if L <= i < m:  # steady state: everything fires
            return self._group_orders
        key = tuple(fires(k, L, i, m) for k in range(L + 1))
        active = self._active_cache.get(key)
        if active is None:
            active = tuple(tuple(t for t in order if key[t.lookahead]) for order in self._group_orders)
            self._active_cache[key] = active
        return active

    def _run_task(self, task: Task) -> None:
        """Run one task of the running iteration (the `run` callable the executor gets)."""
        record = self._records[task]
        i = self._running_iteration
        batch_index = i - self.max_lookahead + record.lookahead
        ctx = TaskContext(task, batch_index, i, self.ring, self.stream_pool, self.state)
        observer = self._running_observer
        try:
            if self._plain and observer is None:
                task.run(ctx)
            elif self._stream_ops:
                self._run_ordered(record, ctx, observer)
            else:
                self._run_observed(record, ctx, observer)
        except Exception as exc:
            raise TaskFailedError(task.name, batch_index, i) from exc

    def _run_ordered(self, record: _TaskRecord, ctx: TaskContext, observer: TaskObserver | None) -> None:
        """Event waits before the task, its work on its stream, its completion event after."""
        pool, ring, stream = self.stream_pool, self.ring, record.stream
        for slot_offset, producer, producer_stream in record.steady_waits if self._steady else record.waits:
            event = ring.at(slot_offset).event(producer)
            if event is None:  # producer has not run yet (prefill): order after its stream
                pool.wait_stream(stream, producer_stream)
            else:
                pool.wait_event(stream, event)
        local = self._thread_stream
        if local.stream != stream or local.seq != self._seq:  # once per run of this thread's tasks on it
            pool.enter(stream)
            local.seq, local.stream = self._seq, stream
        if self._scoped:
            with pool.scope(stream, (record.name, ctx.batch_index)):
                self._run_observed(record, ctx, observer)
        else:
            self._run_observed(record, ctx, observer)
        if record.records_event:  # after all of the task's work on its stream
            store = ring.at(record.lookahead)
            store.record_event(record.name, pool.record_event(stream, store.spare_event(record.name)))

    def _run_observed(self, record: _TaskRecord, ctx: TaskContext, observer: TaskObserver | None) -> None:
        """`task.run(ctx)` inside its NVTX range (if enabled), between the observer's hooks."""
        if self._nvtx:
            nvtx.push_range(record.label)
        try:
            if observer is None:
                record.run(ctx)
                return
            observer.task_started(record.task, ctx.batch_index, ctx.iter_count)
            try:
                record.run(ctx)
            except BaseException:
                observer.task_finished(record.task, ctx.batch_index, ctx.iter_count, True)
                raise
            observer.task_finished(record.task, ctx.batch_index, ctx.iter_count, False)
        finally:
            if self._nvtx:
                nvtx.pop_range()


class _PushMode:
    """Marker iterator for `step()`: batches arrive one by one from the caller."""

    def __repr__(self) -> str:
        return "<push>"


_PUSH = _PushMode()


def _check_pool(graph: DependencyGraph, pool: StreamPool | None) -> None:
    """A precompiled graph still needs every stream it uses in the pool (validation rule 3)."""
    if pool is None:
        return
    problems = [
        Problem(f"stream '{t.stream}' is not in the stream pool (pool has: {', '.join(pool.names)})", t.name, "stream")
        for t in graph.order
        if t.stream not in pool
    ]
    if problems:
        raise TaskGraphValidationError(problems)


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
