"""ThreadedExecutor: submit an iteration's tasks from several CPU threads.

Each thread id (from the thread map) gets one long-lived worker that runs its share of the
iteration's tasks in topological order. Cross-thread order is enforced only where needed:
same-iteration dependencies and same-stream FIFO (two threads feeding one stream must keep the
topological submission order). Collectives stay in one global order on every rank through the
NCCL ordered lock. The first failure cancels everything not yet started and wakes every waiter,
so an iteration always ends, and the failure is raised from the iteration barrier.

Why not `concurrent.futures.ThreadPoolExecutor`: its workers are interchangeable, but a thread
id must map to the same OS thread every iteration (thread-local CUDA/autograd state), and each
chain must be able to block on another without starving the pool.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from recsys_pipe.engine.deps import DependencyGraph, cpu_edges
from recsys_pipe.engine.executor import RunTask
from recsys_pipe.engine.task import Task

ThreadMap = None | str | Mapping[str, str] | Callable[[Task], str]


def resolve_thread_map(thread_map: ThreadMap) -> Callable[[Task], str]:
    """Turn a thread-map spec into `task -> thread id`.

    None / "by_stream": one thread per stream; "per_task": one per task; a dict
    `{task_name: thread_id}` with its "default" entry (else "default") for unlisted tasks;
    or any callable `Task -> str`.
    """
    if thread_map is None or thread_map == "by_stream":
        return lambda task: task.stream or "default"
    if thread_map == "per_task":
        return lambda task: task.name
    if isinstance(thread_map, str):
        raise ValueError(f"unknown thread_map {thread_map!r}: use 'by_stream', 'per_task', a dict or a callable")
    if isinstance(thread_map, Mapping):
        table = dict(thread_map)
        fallback = table.get("default", "default")
        return lambda task: table.get(task.name, fallback)
    if callable(thread_map):
        return thread_map
    raise TypeError(f"thread_map must be None, a strategy name, a dict or a callable, got {thread_map!r}")


class NcclLockAborted(RuntimeError):
    """Raised inside a waiter when the ordered lock is aborted by a failure elsewhere."""


class NcclOrderedLock:
    """Tickets in topological order: task with ticket t runs its collectives only after
    tickets 0..t-1 released, so every rank issues collectives in the same order."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0
        self._failed = False
        self.history: list[int] = []  # tickets in the order they were granted (for tests)

    def reset(self) -> None:
        with self._cond:
            self._next = 0
            self._failed = False
            self.history = []

    def acquire(self, ticket: int) -> None:
        with self._cond:
            while self._next != ticket and not self._failed:
                self._cond.wait()
            if self._failed:
                raise NcclLockAborted(f"NCCL ordered lock aborted while ticket {ticket} waited")
            self.history.append(ticket)

    def release(self, failed: bool = False) -> None:
        with self._cond:
            if failed:
                self._failed = True
            else:
                self._next += 1
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()


@dataclass(frozen=True)
class _Step:
    index: int  # position in the iteration's active order
    task: Task
    waits_for: tuple[int, ...]  # indices of cross-thread predecessors
    signals: bool  # some other thread waits for this step
    ticket: int | None  # NCCL ticket


@dataclass(frozen=True)
class _Plan:
    chains: tuple[tuple[str, tuple[_Step, ...]], ...]
    size: int


class _IterationState:
    """Completion signals, cancellation and errors for one iteration."""

    def __init__(self, plan: _Plan, lock: NcclOrderedLock):
        self.done: list[threading.Event | None] = [None] * plan.size
        for _, chain in plan.chains:
            for s in chain:
                if s.signals:
                    self.done[s.index] = threading.Event()
        self.cancelled = threading.Event()
        self.lock = lock
        self.errors: list[BaseException] = []
        self._errors_lock = threading.Lock()

    def fail(self, exc: BaseException) -> None:
        with self._errors_lock:
            first = not self.errors
            if first or not isinstance(exc, NcclLockAborted):
                self.errors.append(exc)
        self.cancelled.set()
        self.lock.abort()


class _Worker:
    """A daemon thread running jobs from its queue, for the executor's whole life."""

    def __init__(self, thread_id: str):
        self.thread_id = thread_id
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"recsys_pipe:{thread_id}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException:
                pass


class ThreadedExecutor:
    """Runs each thread id's tasks on its own long-lived worker thread.

    `max_workers` caps the number of threads: surplus thread ids are folded onto existing
    workers, whose chains are merged in topological order (always deadlock-free).
    """

    def __init__(self, thread_map: ThreadMap = None, max_workers: int | None = None):
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.thread_map = thread_map
        self.thread_of = resolve_thread_map(thread_map)
        self.max_workers = max_workers
        self.lock = NcclOrderedLock()
        self._workers: dict[str, _Worker] = {}
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self._worker_of: dict[str, str] = {}
        self._closed = False

    @property
    def num_threads(self) -> int:
        return len(self._workers)

    def execute(self, tasks: Sequence[Task], run: RunTask, graph: DependencyGraph) -> None:
        if self._closed:
            raise RuntimeError("ThreadedExecutor was shut down")
        key = tuple(id(t) for t in tasks)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(tasks, graph)
        self.lock.reset()
        state = _IterationState(plan, self.lock)
        finished = []
        for thread_id, chain in plan.chains:
            done = threading.Event()
            finished.append(done)
            self._worker(thread_id).jobs.put(lambda chain=chain, done=done: self._run_chain(chain, run, state, done))
        try:
            for done in finished:
                done.wait()
        except BaseException as exc:  # e.g. KeyboardInterrupt in the driving thread
            state.fail(exc)
            for done in finished:
                done.wait()
            raise
        if state.errors:
            raise state.errors[0]

    def _run_chain(
        self, chain: tuple[_Step, ...], run: RunTask, state: _IterationState, finished: threading.Event
    ) -> None:
        position = 0
        try:
            for position, step in enumerate(chain):  # noqa: B007 - read in `finally`
                if state.cancelled.is_set():
                    break
                for index in step.waits_for:
                    state.done[index].wait()
                if state.cancelled.is_set():
                    break
                try:
                    if step.ticket is not None:
                        state.lock.acquire(step.ticket)
                        try:
                            run(step.task)
                        except BaseException:
                            state.lock.release(failed=True)
                            raise
                        state.lock.release()
                    else:
                        run(step.task)
                except BaseException as exc:
                    state.fail(exc)
                    break
                finally:
                    if step.signals:
                        state.done[step.index].set()
            else:
                position = len(chain)
        finally:
            for step in chain[position:]:  # release everyone waiting on what will not run
                if step.signals:
                    state.done[step.index].set()
            finished.set()

    def _make_plan(self, tasks: Sequence[Task], graph: DependencyGraph) -> _Plan:
        index = {t.name: i for i, t in enumerate(tasks)}
        thread = [self._assign(self.thread_of(t)) for t in tasks]
        preds: list[set[int]] = [set() for _ in tasks]
        for edge in cpu_edges(graph, tasks):
            preds[index[edge.consumer]].add(index[edge.producer])
        cross = [tuple(sorted(p for p in preds[i] if thread[p] != thread[i])) for i in range(len(tasks))]
        signals = {p for waits in cross for p in waits}
        tickets: dict[int, int] = {}
        for i, t in enumerate(tasks):
            if t.nccl:
                tickets[i] = len(tickets)
        chains: dict[str, list[_Step]] = {}
        for i, t in enumerate(tasks):
            chains.setdefault(thread[i], []).append(_Step(i, t, cross[i], i in signals, tickets.get(i)))
        return _Plan(tuple((tid, tuple(steps)) for tid, steps in chains.items()), len(tasks))

    def _assign(self, thread_id: Any) -> str:
        """Map a thread id to a worker, folding ids beyond `max_workers` onto existing ones."""
        thread_id = str(thread_id)
        worker = self._worker_of.get(thread_id)
        if worker is None:
            distinct = list(dict.fromkeys(self._worker_of.values()))
            if self.max_workers is not None and len(distinct) >= self.max_workers:
                worker = distinct[len(self._worker_of) % self.max_workers]
            else:
                worker = thread_id
            self._worker_of[thread_id] = worker
        return worker

    def _worker(self, thread_id: str) -> _Worker:
        worker = self._workers.get(thread_id)
        if worker is None:
            worker = self._workers[thread_id] = _Worker(thread_id)
        return worker

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the workers. Returns promptly: workers are daemons, joined with a timeout."""
        if self._closed:
            return
        self._closed = True
        self.lock.abort()
        for worker in self._workers.values():
            worker.jobs.put(None)
        for worker in self._workers.values():
            worker.thread.join(timeout)
        self._workers.clear()

    def __repr__(self) -> str:
        return f"ThreadedExecutor(thread_map={self.thread_map!r}, max_workers={self.max_workers})"
