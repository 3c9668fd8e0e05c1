"""ThreadedExecutor: submit an iteration's tasks from several CPU threads.

Each thread id (from the thread map) owns a chain: its share of the iteration's tasks in
topological order. The chain of the training step (the thread id holding most of the
lowest-lookahead tasks) runs on the thread that called `progress()`; every other thread id gets
one long-lived worker. Cross-thread order is enforced only where
needed, by one-shot latches: same-iteration dependencies, same-stream FIFO (two threads feeding
one stream must keep the topological submission order), and NCCL order — every `nccl` task
starts after the previous `nccl` task in topological order has finished, so every rank issues
its collectives in the same order whatever the threads do. All these edges point forward in
one total order and each chain runs in that order, so the lowest unfinished task can always
run: no deadlock.

A worker chain whose first task waits on another thread is handed to its worker only when the
last of those predecessors in topological order opens its latch, not at the start of the
iteration: the worker then usually wakes once, ready to run, instead of waking at the start only
to sleep again on a latch. (Waiting for all of them with a count, so that it always wakes once,
measured no faster with one thread per task: 160-175 against 156-164 µs per step.)
With one thread per task every worker would otherwise wake twice per iteration, and the
wake-ups at the start all compete with the caller's first tasks for the GIL. Deferring keeps the
order argument above: the chain's trigger comes before its first task in the total order, so by
induction on that order every chain is handed over.

The first failure cancels everything not yet started; every chain still releases the latches
(and hands over the chains) of the steps it will not run, so no waiter is left behind, and the
failure is raised once all chains have stopped.

Why not `concurrent.futures.ThreadPoolExecutor`: its workers are interchangeable, but a thread
id must map to the same OS thread every iteration (thread-local CUDA/autograd state), and each
chain must be able to block on another without starving the pool. Why plain locks as latches
rather than `threading.Event`: an Event costs about 2 µs to create plus a Condition round trip
per set and wait; a pre-locked `threading.Lock` is created, opened and passed through in about
0.1 µs each. Every iteration makes fresh ones, so no state carries over between iterations.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
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


class _Step:
    """One task of a chain: the latches to pass before it, the latch it releases after and the
    worker chains handed over once that latch is open."""

    __slots__ = ("task", "waits_for", "signal", "hands_over")

    def __init__(self, task: Task, waits_for: tuple[int, ...], signal: int):
        self.task = task
        self.waits_for = waits_for  # latch indices of cross-thread predecessors
        self.signal = signal  # latch index other threads wait on, or -1
        self.hands_over: tuple[int, ...] = ()  # indices into _Plan.workers, set by _make_plan


class _Plan:
    """How one set of firing tasks is split over threads (cached per set)."""

    __slots__ = ("caller", "workers", "num_latches", "eager")

    def __init__(self, caller: tuple[_Step, ...], workers: tuple[tuple[_Worker, tuple[_Step, ...]], ...], latches: int):
        self.caller = caller  # the chain run on the thread that called execute()
        self.workers = workers  # (worker thread, its chain)
        self.num_latches = latches
        # Chains handed over at the start: those whose first task waits on no other thread.
        # The others are handed over by the step named in their trigger's `hands_over`.
        self.eager = tuple(k for k, (_, chain) in enumerate(workers) if not chain[0].waits_for)


def closed_latch() -> Any:
    """A closed one-shot latch: `release()` opens it; a waiter passes with acquire + release."""
    lock = threading.Lock()
    lock.acquire()
    return lock


def open_latch(latch: Any) -> None:
    """Open a latch; opening it twice is harmless (the failure paths may race a normal release)."""
    try:
        latch.release()
    except RuntimeError:  # already open
        pass


class _IterationState:
    """Latches, cancellation, errors, the hand-over of worker chains and the count of running
    workers of one iteration."""

    __slots__ = ("latches", "cancelled", "errors", "running", "finished", "plan", "run", "_posted", "_closed", "_lock")

    def __init__(self, plan: _Plan, run: RunTask):
        self.latches = [closed_latch() for _ in range(plan.num_latches)]
        self.cancelled = False
        self.errors: list[BaseException] = []
        self.running = len(plan.workers)
        self.finished = closed_latch()  # opened by the last worker to finish: one wake-up for the caller
        self.plan, self.run = plan, run
        self._posted = [False] * len(plan.workers)
        self._closed = False  # no more hand-overs: the caller is unwinding
        self._lock = threading.Lock()

    def hand_over(self, k: int) -> None:
        """Give worker chain `k` to its thread, once."""
        with self._lock:
            if self._posted[k] or self._closed:
                return
            self._posted[k] = True
        worker, chain = self.plan.workers[k]
        worker.jobs.put((chain, self.run, self))

    def hand_over_eager(self) -> None:
        """Give every chain that waits on no other thread to its thread: at the start of the
        iteration, before any worker runs (so without the lock)."""
        workers, posted, job = self.plan.workers, self._posted, (self.run, self)
        for k in self.plan.eager:
            posted[k] = True
            worker, chain = workers[k]
            worker.jobs.put((chain, *job))

    def signal(self, step: _Step) -> None:
        """Open `step`'s latch, then hand over the chains it triggers."""
        if step.signal >= 0:
            open_latch(self.latches[step.signal])
        for k in step.hands_over:
            self.hand_over(k)

    def close(self) -> int:
        """Stop handing chains over; returns how many never were (they will never run)."""
        with self._lock:
            self._closed = True
            return self._posted.count(False)

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            self.errors.append(exc)
        self.cancelled = True

    def worker_finished(self) -> None:
        with self._lock:
            self.running -= 1
            last = self.running == 0
        if last:
            open_latch(self.finished)

    def open_all(self) -> None:
        """Wake every waiter (they see `cancelled` and stop): for a caller interrupted while it
        may have been passing through a latch."""
        for latch in self.latches:
            open_latch(latch)


def _run_chain(chain: Sequence[_Step], run: RunTask, state: _IterationState) -> None:
    """Run a chain's steps in order; after a failure anywhere, skip the rest. Every step's
    latch is opened whatever happens, so no other chain waits forever.

    The per-step path is the executor's own cost on every task, so it stays flat: a step with no
    latch to pass, none to open and no chain to hand over costs two checks and the call."""
    latches = state.latches
    opened = 0  # chain[:opened] have opened their latch
    try:
        for step in chain:
            if not state.cancelled:
                for index in step.waits_for:
                    latch = latches[index]
                    latch.acquire()
                    open_latch(latch)
                if not state.cancelled:
                    try:
                        run(step.task)
                    except BaseException as exc:
                        state.fail(exc)
            if step.signal >= 0:
                open_latch(latches[step.signal])
            if step.hands_over:
                for k in step.hands_over:
                    state.hand_over(k)
            opened += 1
    finally:
        for step in chain[opened:]:
            state.signal(step)


class _Worker:
    """A daemon thread running chains from its queue, for the executor's whole life."""

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
            chain, run, state = job
            try:
                _run_chain(chain, run, state)
            except BaseException as exc:  # a bug in the chain runner itself: still end the iteration
                state.fail(exc)
            finally:
                state.worker_finished()


class ThreadedExecutor:
    """Runs each thread id's tasks on one CPU thread.

    The training step runs on the thread calling `progress()`: the thread id holding the most
    tasks of the task graph's lowest lookahead (ties: the one whose such task comes first in
    topological order). Every other thread id gets its own long-lived worker. Running that chain
    in place spares the critical chain a thread wake-up per iteration, and its tasks see the
    caller's thread-local state (grad mode, current device), so call `progress()` from one
    thread.

    `max_workers` caps the number of threads that run tasks, the calling thread included:
    surplus thread ids are folded onto existing ones, whose chains are merged in topological
    order (always deadlock-free).
    """

    def __init__(self, thread_map: ThreadMap = None, max_workers: int | None = None):
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.thread_map = thread_map
        self.thread_of = resolve_thread_map(thread_map)
        self.max_workers = max_workers
        self._workers: dict[str, _Worker] = {}
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self._last: tuple[Sequence[Task], _Plan] | None = None  # the plan runner passes the same tuples
        self._worker_of: dict[str, str] = {}
        self._caller_of: dict[int, str] = {}  # id(graph) -> thread id run by the caller
        self._closed = False

    @property
    def num_threads(self) -> int:
        """CPU threads that have run tasks: the workers plus the calling thread."""
        return len(self._workers) + bool(self._caller_of)

    def thread_id(self, task: Task) -> str:
        """The thread id `task` runs under (after folding by `max_workers`): the name its worker
        thread carries (`recsys_pipe:<id>`), or the id of the chain the calling thread runs."""
        return self._assign(self.thread_of(task))

    def execute(self, tasks: Sequence[Task], run: RunTask, graph: DependencyGraph) -> None:
        """Run one iteration's firing tasks on their threads (see the class docstring).

        Args:
            tasks: the tasks that fire this iteration, in topological order.
            run: runs one task (its stream context, waits, events and observer hooks included).
            graph: the compiled task graph, whose CPU edges the threads wait on."""
        if self._closed:
            raise RuntimeError("ThreadedExecutor was shut down")
        last = self._last
        if last is not None and last[0] is tasks:
            plan = last[1]
        else:
            key = tuple(map(id, tasks))
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plans[key] = self._make_plan(tasks, graph)
            self._last = (tasks, plan)
        state = _IterationState(plan, run)
        try:
            state.hand_over_eager()
            _run_chain(plan.caller, run, state)
            if plan.workers:
                state.finished.acquire()
        except BaseException as exc:  # e.g. KeyboardInterrupt in the calling thread
            state.fail(exc)
            state.open_all()
            for _ in range(state.close()):  # chains never handed over
                state.worker_finished()
            # Workers stop at their next step. Count, not the latch: the interrupt may have come
            # just after the latch was taken. Bounded: a task stuck in a collective must not hang Ctrl-C.
            deadline = time.monotonic() + 30.0
            while state.running > 0 and time.monotonic() < deadline:
                state.finished.acquire(True, 0.1)
            raise
        if state.errors:
            raise state.errors[0]

    def _make_plan(self, tasks: Sequence[Task], graph: DependencyGraph) -> _Plan:
        caller = self._caller_thread(graph)
        index = {t.name: i for i, t in enumerate(tasks)}
        thread = [self._assign(self.thread_of(t)) for t in tasks]
        preds: list[set[int]] = [set() for _ in tasks]
        for edge in cpu_edges(graph, tasks):
            preds[index[edge.consumer]].add(index[edge.producer])
        previous_nccl = None
        for i, t in enumerate(tasks):  # collectives in topological order on every rank
            if t.nccl:
                if previous_nccl is not None:
                    preds[i].add(previous_nccl)
                previous_nccl = i
        waits_on: list[tuple[int, ...]] = []
        for i in range(len(tasks)):
            # Per other thread only its latest predecessor: that thread ran the earlier ones first.
            latest: dict[str, int] = {}
            for p in preds[i]:
                if thread[p] != thread[i]:
                    latest[thread[p]] = max(p, latest.get(thread[p], -1))
            waits_on.append(tuple(sorted(latest.values())))
        latch_of = {p: n for n, p in enumerate(sorted({p for waits in waits_on for p in waits}))}
        chains: dict[str, list[_Step]] = {}
        trigger_of: dict[int, _Step] = {}  # latch -> the step opening it
        for i, t in enumerate(tasks):
            step = _Step(t, tuple(latch_of[p] for p in waits_on[i]), latch_of.get(i, -1))
            chains.setdefault(thread[i], []).append(step)
            if step.signal >= 0:
                trigger_of[step.signal] = step
        caller_chain = tuple(chains.pop(caller, ()))
        workers = tuple((self._worker(tid), tuple(steps)) for tid, steps in chains.items())
        # A chain whose first step waits on other threads is handed over by the step opening the
        # latest of those latches (latches are numbered in topological order of their producers).
        for k, (_, steps) in enumerate(workers):
            if steps[0].waits_for:
                trigger = trigger_of[max(steps[0].waits_for)]
                trigger.hands_over = (*trigger.hands_over, k)
        return _Plan(caller_chain, workers, len(latch_of))

    def _caller_thread(self, graph: DependencyGraph) -> str:
        """The thread id run by the calling thread, chosen once per task graph (over all its tasks,
        so the choice does not change between prefill, steady state and drain)."""
        caller = self._caller_of.get(id(graph))
        if caller is None:
            lowest = min(t.lookahead for t in graph.order)
            count: dict[str, int] = {}
            for t in graph.order:  # assign in topological order: worker folding is deterministic
                tid = self._assign(self.thread_of(t))
                if t.lookahead == lowest:
                    count[tid] = count.get(tid, 0) + 1
            caller = max(count, key=count.__getitem__)  # first maximum: its task comes first
            self._caller_of[id(graph)] = caller
        return caller

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
        for worker in self._workers.values():
            worker.jobs.put(None)
        for worker in self._workers.values():
            worker.thread.join(timeout)
        self._workers.clear()

    def __repr__(self) -> str:
        return f"ThreadedExecutor(thread_map={self.thread_map!r}, max_workers={self.max_workers})"
