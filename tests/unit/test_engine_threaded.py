"""ThreadedExecutor: same results as sequential, ordered collectives, no hangs."""

import linecache
import random
import signal
import sys
import threading
import time

import pytest
from _task_graphs import Trace, build, task_graph_specs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsys_pipe.engine import (
    PlanRunner,
    PlanRunnerBrokenError,
    Task,
    TaskFailedError,
    TaskGraph,
    TaskGroup,
    ThreadedExecutor,
    resolve_thread_map,
)
from recsys_pipe.engine.testing import check_happens_before, recording_pool

pytestmark = pytest.mark.timeout(120)

THREAD_MAPS = {
    "by_stream": lambda: "by_stream",
    "none": lambda: None,
    "per_task": lambda: "per_task",
    "dict": lambda: {"t0": "io", "t2": "io", "default": "compute"},
    "callable": lambda: lambda task: "even" if task.lookahead % 2 == 0 else "odd",
    "single": lambda: {"default": "main"},
}


def traced_run(specs, executor, m, jitter=0.0, seed=0):
    trace = Trace(jitter=jitter, seed=seed)
    task_graph = build(specs, trace)
    pool, log = recording_pool(task_graph.stream_slots)
    with PlanRunner(task_graph, pool, executor) as runner:
        results = list(runner.iterate(range(m)))
    return trace, results, check_happens_before(log, task_graph)


HAND_WRITTEN = [
    {"name": "t0", "lookahead": 2, "stream": "s1", "reads": ["batch_cpu"], "writes": ["v0"]},
    {"name": "t1", "lookahead": 1, "stream": "s2", "reads": ["v0"], "writes": ["v1"], "depends_on": ["t0"]},
    {"name": "t2", "lookahead": 1, "stream": "s2", "reads": ["v1"], "writes": ["v2"], "depends_on": ["t1"]},
    {"name": "t3", "lookahead": 0, "stream": "default", "reads": ["v2"], "writes": ["v3"]},
    {
        "name": "t4",
        "lookahead": 0,
        "stream": "default",
        "reads": ["v3"],
        "writes": ["step_result"],
        "same_progress_sync": ["t2"],
    },
    {"name": "t5", "lookahead": 2, "stream": "s1", "writes": ["v5"], "cross_iter_depends_on": [("t0", -1)]},
]


@pytest.mark.parametrize("thread_map", sorted(THREAD_MAPS))
def test_threaded_equals_sequential_on_hand_written_task_graph(thread_map):
    ref, ref_results, ref_violations = traced_run(HAND_WRITTEN, "sequential", 9)
    got, results, violations = traced_run(HAND_WRITTEN, ThreadedExecutor(THREAD_MAPS[thread_map]()), 9, jitter=0.002)
    assert ref_violations == violations == []
    assert got.reads == ref.reads and got.writes == ref.writes
    assert results == ref_results and len(results) == 9


@given(
    specs=task_graph_specs(),
    m=st.integers(0, 6),
    thread_map=st.sampled_from(sorted(THREAD_MAPS)),
    seed=st.integers(0, 1000),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_threaded_equals_sequential_on_random_task_graphs(specs, m, thread_map, seed):
    ref, ref_results, _ = traced_run(specs, "sequential", m)
    got, results, violations = traced_run(
        specs, ThreadedExecutor(THREAD_MAPS[thread_map]()), m, jitter=0.001, seed=seed
    )
    assert violations == []
    assert got.reads == ref.reads and got.writes == ref.writes
    assert results == ref_results


def test_nccl_ticket_order_is_topological_order_under_random_delays():
    issued: dict[int, list[str]] = {}
    lock = threading.Lock()
    rng = random.Random(7)

    def collective(ctx):
        time.sleep(rng.random() * 0.003)
        with lock:
            issued.setdefault(ctx.iter_count, []).append(ctx.task.name)

    def task(name, **kw):
        return Task.from_fn(name, collective, nccl=True, **kw)

    tasks = [
        task("shuffle", stream="memcpy", lookahead=2),
        task("start_dist", stream="dist", lookahead=1, depends_on=["shuffle"]),
        task("wait_dist", stream="dist", lookahead=1, depends_on=["start_dist"]),
        task("tokens", lookahead=0),
        Task.from_fn("forward", lambda ctx: time.sleep(rng.random() * 0.003), lookahead=0),
        task("backward", lookahead=0, depends_on=["forward"]),
        task("finalize", lookahead=0, depends_on=["backward"]),
    ]
    executor = ThreadedExecutor("per_task")
    runner = PlanRunner(TaskGraph.single_group(tasks), executor=executor)
    topo_nccl = [t.name for t in runner.graph.order if t.nccl]
    assert topo_nccl == ["shuffle", "start_dist", "wait_dist", "tokens", "backward", "finalize"]
    list(runner.iterate(range(12)))
    assert sorted(issued) == list(range(14))
    for _i, names in issued.items():  # issue order == topological order of that iteration's nccl tasks
        assert names == [name for name in topo_nccl if name in names]
    runner.shutdown()


def draw_thread_map(data, names):
    """A named thread map, or a random assignment of the tasks to 1-4 thread ids."""
    choice = data.draw(st.sampled_from([*sorted(THREAD_MAPS), "random"]))
    if choice != "random":
        return THREAD_MAPS[choice]()
    return {name: f"w{data.draw(st.integers(0, 3))}" for name in names}


def nccl_checked_body(trace, events, lock, jitter_rng=None):
    """Runs `trace.body`, logging the start and end of every nccl task (for the order checks)."""

    def body(ctx):
        if ctx.task.nccl:
            with lock:
                events.append(("start", ctx.task.name, ctx.iter_count))
        if jitter_rng is not None:
            with lock:
                delay = jitter_rng.random() * 0.0005
            time.sleep(delay)
        trace.body(ctx)
        if ctx.task.nccl:
            with lock:
                events.append(("end", ctx.task.name, ctx.iter_count))

    return body


def assert_nccl_order(events, order, ran):
    """Per iteration: nccl tasks ran one at a time, in topological order."""
    by_iteration = {}
    for kind, name, i in events:
        by_iteration.setdefault(i, []).append((kind, name))
    for i, seq in by_iteration.items():
        expected = [t.name for t in order if t.nccl and (t.name, i) in ran]
        assert seq == [(kind, name) for name in expected for kind in ("start", "end")], f"iteration {i}: {seq}"


@given(specs=task_graph_specs(), m=st.integers(0, 6), data=st.data(), seed=st.integers(0, 1000))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_thread_assignment_and_nccl_flags_match_sequential(specs, m, data, seed):
    """Stress for the latches: any split of the tasks over threads (and folding by max_workers)
    gives the sequential results, the stream order, and one global order of collectives."""
    names = [s["name"] for s in specs]
    nccl = {name: data.draw(st.booleans()) for name in names}
    specs = [{**s, "nccl": nccl[s["name"]]} for s in specs]
    thread_map = draw_thread_map(data, names)
    max_workers = data.draw(st.sampled_from([None, 1, 2]))
    ref, ref_results, _ = traced_run(specs, "sequential", m)
    trace, events, lock = Trace(), [], threading.Lock()
    body = nccl_checked_body(trace, events, lock, random.Random(seed))
    tasks = [Task.from_fn(s["name"], body, **{k: v for k, v in s.items() if k != "name"}) for s in specs]
    task_graph = TaskGraph(groups=(TaskGroup(tuple(tasks)),), stream_slots=("default", "s1", "s2"))
    pool, log = recording_pool(task_graph.stream_slots)
    with PlanRunner(task_graph, pool, ThreadedExecutor(thread_map, max_workers)) as runner:
        results = list(runner.iterate(range(m)))
        order = runner.graph.order
    assert check_happens_before(log, task_graph) == []
    assert trace.reads == ref.reads and trace.writes == ref.writes and results == ref_results
    ran = {
        (name, b + runner.max_lookahead - next(t.lookahead for t in tasks if t.name == name)) for name, b in trace.reads
    }
    assert_nccl_order(events, order, ran)


def test_long_run_per_task_threads_keeps_results_and_collective_order():
    """Many iterations of an HSTU-shaped plan with one thread per task: every iteration makes
    fresh latches, and none may leak into the next."""
    specs = [
        {"name": "h2d", "lookahead": 2, "stream": "s1", "reads": ["batch_cpu"], "writes": ["gpu"]},
        {"name": "start", "lookahead": 1, "stream": "s2", "reads": ["gpu"], "writes": ["splits"], "nccl": True},
        {"name": "wait", "lookahead": 1, "stream": "s2", "reads": ["splits"], "writes": ["dist"], "nccl": True},
        {"name": "zero", "lookahead": 0},
        {"name": "tokens", "lookahead": 0, "reads": ["gpu"], "writes": ["tok"], "nccl": True},
        {"name": "fwd", "lookahead": 0, "reads": ["dist", "gpu"], "writes": ["loss"], "depends_on": ["zero"]},
        {
            "name": "pre",
            "lookahead": 1,
            "stream": "s1",
            "reads": ["dist"],
            "writes": ["pf"],
            "same_progress_sync": ["fwd"],
        },
        {"name": "bwd", "lookahead": 0, "reads": ["loss", "tok"], "nccl": True, "same_progress_sync": ["pre"]},
        {"name": "fin", "lookahead": 0, "depends_on": ["bwd"], "nccl": True},
        {"name": "opt", "lookahead": 0, "reads": ["loss"], "writes": ["step_result"], "depends_on": ["fin"]},
    ]
    m = 400
    ref, ref_results, _ = traced_run(specs, "sequential", m)
    trace, events, lock = Trace(), [], threading.Lock()
    body = nccl_checked_body(trace, events, lock)
    tasks = [Task.from_fn(s["name"], body, **{k: v for k, v in s.items() if k != "name"}) for s in specs]
    task_graph = TaskGraph(groups=(TaskGroup(tuple(tasks)),), stream_slots=("default", "s1", "s2"))
    with PlanRunner(task_graph, executor=ThreadedExecutor("per_task")) as runner:
        results = list(runner.iterate(range(m)))
        order = runner.graph.order
    assert results == ref_results and trace.reads == ref.reads
    ran = {(name, b + 2 - next(t.lookahead for t in tasks if t.name == name)) for name, b in trace.reads}
    assert_nccl_order(events, order, ran)
    assert len(events) == 2 * 5 * m


@given(specs=task_graph_specs(max_tasks=5), m=st.integers(1, 5), data=st.data())
@settings(max_examples=220, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_failure_injection_always_surfaces_and_never_hangs(specs, m, data):
    names = [s["name"] for s in specs]
    victim = data.draw(st.sampled_from(names))
    batch = data.draw(st.integers(0, m - 1))
    nccl = {name: data.draw(st.booleans()) for name in names}
    thread_map = draw_thread_map(data, names)
    jitter = data.draw(st.sampled_from([0.0, 0.0005]))
    trace = Trace(jitter=jitter)

    def body(ctx):
        if ctx.task.name == victim and ctx.batch_index == batch:
            raise RuntimeError("injected")
        trace.body(ctx)

    tasks = [
        Task.from_fn(s["name"], body, nccl=nccl[s["name"]], **{k: v for k, v in s.items() if k != "name"})
        for s in specs
    ]
    task_graph = TaskGraph(groups=(TaskGroup(tuple(tasks)),), stream_slots=("default", "s1", "s2"))
    before = threading.active_count()
    runner = PlanRunner(task_graph, executor=ThreadedExecutor(thread_map))
    it = iter(range(m))
    start = time.monotonic()
    with pytest.raises(TaskFailedError) as info:
        list(runner.iterate(it))
    assert (info.value.task, info.value.batch_index) == (victim, batch)
    assert isinstance(info.value.__cause__, RuntimeError) and str(info.value.__cause__) == "injected"
    with pytest.raises(PlanRunnerBrokenError):
        runner.progress(it)
    runner.shutdown()
    assert time.monotonic() - start < 10
    assert threading.active_count() == before  # every worker left its chain and stopped


def test_failure_cancels_tasks_not_yet_started():
    ran = []

    def slow_ok(ctx):
        time.sleep(0.05)
        ran.append(ctx.task.name)

    def boom(ctx):
        raise ValueError("boom")

    tasks = [
        Task.from_fn("boom", boom, stream="io"),
        Task.from_fn("a", slow_ok, depends_on=["boom"]),
        Task.from_fn("b", slow_ok, depends_on=["a"]),
    ]
    runner = PlanRunner(TaskGraph.single_group(tasks), executor=ThreadedExecutor("per_task"))
    with pytest.raises(TaskFailedError, match="task 'boom' failed on batch 0"):
        runner.progress(iter(range(3)))
    assert ran == []
    runner.shutdown()


def test_thread_map_strategies_resolve_as_specified():
    t = Task.from_fn("h2d", lambda ctx: None, stream="memcpy")
    u = Task.from_fn("forward", lambda ctx: None)
    assert resolve_thread_map(None)(t) == resolve_thread_map("by_stream")(t) == "memcpy"
    assert resolve_thread_map("per_task")(t) == "h2d"
    assert resolve_thread_map({"h2d": "io", "default": "compute"})(t) == "io"
    assert resolve_thread_map({"h2d": "io", "default": "compute"})(u) == "compute"
    assert resolve_thread_map({"h2d": "io"})(u) == "default"
    assert resolve_thread_map(lambda task: task.name.upper())(u) == "FORWARD"
    with pytest.raises(ValueError, match="unknown thread_map"):
        resolve_thread_map("by_thread")


@pytest.mark.parametrize(
    "thread_map, max_workers, expected",
    [
        ("by_stream", None, 3),
        ("per_task", None, 6),
        ({"default": "x"}, None, 1),
        ("per_task", 2, 2),
    ],
)
def test_thread_count_bounded_by_distinct_thread_ids(thread_map, max_workers, expected):
    """One CPU thread per thread id, the calling thread included: it runs the training step."""
    executor = ThreadedExecutor(thread_map, max_workers=max_workers)
    before = threading.active_count()
    ref, _, _ = traced_run(HAND_WRITTEN, "sequential", 6)
    trace = Trace()
    ran_on: dict[str, set[str]] = {}

    def body(ctx):
        ran_on.setdefault(ctx.task.name, set()).add(threading.current_thread().name)
        trace.body(ctx)

    tasks = [Task.from_fn(s["name"], body, **{k: v for k, v in s.items() if k != "name"}) for s in HAND_WRITTEN]
    runner = PlanRunner(
        TaskGraph(groups=(TaskGroup(tuple(tasks)),), stream_slots=("default", "s1", "s2")), None, executor
    )
    for _ in range(3):  # workers are long-lived: iterations create no threads
        list(runner.iterate(range(6)))
        assert executor.num_threads == expected
        assert threading.active_count() - before == expected - 1
        assert trace.reads == ref.reads
        trace.reads.clear()
    assert all(len(names) == 1 for names in ran_on.values())  # a thread id keeps its OS thread
    threads = {name for names in ran_on.values() for name in names}
    assert len(threads) == expected and threading.current_thread().name in threads
    if thread_map == "by_stream":  # the lookahead-0 tasks' stream runs on the caller
        assert ran_on["t3"] == ran_on["t4"] == {threading.current_thread().name}
    if thread_map == "per_task":  # one lookahead-0 task each: the first in topological order
        assert ran_on["t3"] == {threading.current_thread().name}
    runner.shutdown()
    assert threading.active_count() == before


def test_a_chain_waiting_on_another_thread_is_handed_over_when_its_trigger_opens():
    """Its worker gets the chain once the latest of its first task's predecessors has run, not
    at the start of the iteration: it wakes once, ready to run. Chains with nothing to wait for
    start at once; results and the order of every task stay those of the sequential executor."""
    handed: list[tuple[str, tuple[str, ...]]] = []  # (worker's thread id, tasks done by then)
    done: list[str] = []
    lock = threading.Lock()

    def body(ctx):
        time.sleep(0.002)
        with lock:
            done.append(ctx.task.name)

    tasks = [
        Task.from_fn("load", body, stream="io"),  # no predecessor: handed over at the start
        Task.from_fn("a", body),
        Task.from_fn("b", body, stream="s1", depends_on=["a"]),
        Task.from_fn("c", body, stream="s2", depends_on=["a", "b"]),  # latest predecessor: b
        Task.from_fn("d", body, depends_on=["c"]),
    ]
    executor = ThreadedExecutor("by_stream")
    runner = PlanRunner(TaskGraph.single_group(tasks), executor=executor)
    list(runner.iterate(range(1)))  # starts the workers

    class Spy:  # the worker's job queue, noting what had run when a chain was handed over
        def __init__(self, worker):
            self.worker, self.queue = worker, worker.jobs

        def put(self, job):
            if job is not None:
                with lock:
                    handed.append((self.worker.thread_id, tuple(done)))
            self.queue.put(job)

        def get(self):
            return self.queue.get()

    for worker in executor._workers.values():
        worker.jobs = Spy(worker)  # read by the worker's loop at its next get()
    done.clear()
    list(runner.iterate(range(1)))
    runner.shutdown()
    when = dict(handed)
    assert len(handed) == 3 and when["io"] == ()
    assert "a" in when["s1"] and "b" not in when["s1"]
    assert "b" in when["s2"] and "c" not in when["s2"]
    assert done.index("c") > done.index("b") > done.index("a") and done[-1] == "d"


def test_shutdown_is_prompt_and_idempotent():
    runner = PlanRunner(build(HAND_WRITTEN, Trace()), executor="threaded")
    list(runner.iterate(range(3)))
    start = time.monotonic()
    runner.shutdown()
    runner.shutdown()
    assert time.monotonic() - start < 1
    with pytest.raises(PlanRunnerBrokenError, match="shut down"):
        runner.progress(iter(range(2)))


@pytest.mark.parametrize("raised_on", ["caller", "worker"])
def test_keyboard_interrupt_in_a_task_propagates_and_breaks_the_runner(raised_on):
    def interrupt(ctx):
        if ctx.batch_index == 1:
            raise KeyboardInterrupt

    def slow(ctx):
        time.sleep(0.01)

    # "b" and "c" on the caller (the lookahead-0 stream), "a" on a worker
    tasks = [
        Task.from_fn("a", interrupt if raised_on == "worker" else slow, stream="s1"),
        Task.from_fn("b", interrupt if raised_on == "caller" else slow, depends_on=["a"]),
        Task.from_fn("c", slow, depends_on=["b"]),
    ]
    before = threading.active_count()
    runner = PlanRunner(TaskGraph.single_group(tasks), executor=ThreadedExecutor("by_stream"))
    it = iter(range(4))
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        list(runner.iterate(it))
    with pytest.raises(PlanRunnerBrokenError, match="KeyboardInterrupt in iteration 1"):
        runner.progress(it)
    runner.shutdown()
    assert time.monotonic() - start < 5 and threading.active_count() == before


def _blocked_in_a_wait(thread_id: int) -> bool:
    """Whether the thread's innermost Python frame is on a lock wait (`.acquire(`): a
    threading.Lock, Event or Condition blocks in one."""
    frame = sys._current_frames().get(thread_id)
    return frame is not None and ".acquire(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)


@pytest.mark.parametrize("caller_blocked_on", ["dependency", "end_of_iteration"])
def test_signal_while_the_caller_waits_does_not_hang(caller_blocked_on):
    """Ctrl-C reaches the caller while it is blocked on a worker: the iteration is cancelled,
    the workers are released, and KeyboardInterrupt propagates.

    No timing is assumed: the worker task sends SIGINT once the caller is seen blocked in a
    wait, and keeps running until the caller's handler has run (sending again if the signal
    came just before the wait started, when the interpreter runs the handler only after it)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only; this test needs to run on it")
    main = threading.main_thread().ident
    ran = []
    blocked, handled = threading.Event(), threading.Event()

    def on_sigint(signum, frame):  # Python's Ctrl-C (KeyboardInterrupt), once, saying when it ran
        if not handled.is_set():
            handled.set()
            raise KeyboardInterrupt

    def send_sigint(ctx):
        if ctx.batch_index == 1:
            deadline = time.monotonic() + 30
            while not _blocked_in_a_wait(main) and time.monotonic() < deadline:
                time.sleep(0.001)
            if _blocked_in_a_wait(main):
                blocked.set()
            while not handled.is_set() and time.monotonic() < deadline:
                signal.pthread_kill(main, signal.SIGINT)
                handled.wait(0.05)  # the caller is interrupted while this task is still running
        ran.append((ctx.task.name, ctx.batch_index))

    def record(ctx):
        ran.append((ctx.task.name, ctx.batch_index))

    depends = ["w"] if caller_blocked_on == "dependency" else []
    tasks = [
        Task.from_fn("w", send_sigint, stream="s1"),
        Task.from_fn("c1", record, depends_on=depends),
        Task.from_fn("c2", record),
        # handed over only once c1 is done: with the caller interrupted before, it never is
        Task.from_fn("after", record, stream="s2", depends_on=["c1"]),
    ]
    before = threading.active_count()
    runner = PlanRunner(TaskGraph.single_group(tasks), executor=ThreadedExecutor("by_stream"))
    it = iter(range(4))
    # the handler is installed here, not inherited: a process started in the background by a
    # non-interactive shell (a CI job's `pytest &`) inherits SIGINT ignored, and Python then
    # leaves it ignored, so no KeyboardInterrupt would come
    previous = signal.signal(signal.SIGINT, on_sigint)
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            list(runner.iterate(it))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert blocked.is_set() and handled.is_set()  # the state under test was reached
    assert time.monotonic() - start < 5
    assert ("w", 1) in ran and ("w", 2) not in ran
    if caller_blocked_on == "dependency":
        assert ("c1", 1) not in ran  # cancelled: its producer's batch was interrupted
        assert ("after", 1) not in ran
    else:
        assert ("c1", 1) in ran and ("c2", 1) in ran  # the caller's own tasks ran, then it waited
    with pytest.raises(PlanRunnerBrokenError):
        runner.progress(it)
    runner.shutdown()
    assert threading.active_count() == before
