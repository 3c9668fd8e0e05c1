"""ThreadedExecutor (SPEC §6): same results as sequential, ordered collectives, no hangs."""

import random
import threading
import time

import pytest
from _schedules import Trace, build, run_all, schedule_specs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsys_pipe.engine import (
    NcclLockAborted,
    NcclOrderedLock,
    PipelineBrokenError,
    SchedulablePipeline,
    Schedule,
    Stage,
    Task,
    TaskFailedError,
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
    schedule = build(specs, trace)
    pool, log = recording_pool(schedule.stream_slots)
    with SchedulablePipeline(schedule, pool, executor) as pipe:
        results = run_all(pipe, range(m))
    return trace, results, check_happens_before(log, schedule)


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
def test_threaded_equals_sequential_on_hand_written_schedule(thread_map):
    ref, ref_results, ref_violations = traced_run(HAND_WRITTEN, "sequential", 9)
    got, results, violations = traced_run(HAND_WRITTEN, ThreadedExecutor(THREAD_MAPS[thread_map]()), 9, jitter=0.002)
    assert ref_violations == violations == []
    assert got.reads == ref.reads and got.writes == ref.writes
    assert results == ref_results and len(results) == 9


@given(
    specs=schedule_specs(),
    m=st.integers(0, 6),
    thread_map=st.sampled_from(sorted(THREAD_MAPS)),
    seed=st.integers(0, 1000),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_threaded_equals_sequential_on_random_schedules(specs, m, thread_map, seed):
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
    pipe = SchedulablePipeline(Schedule.single_stage(tasks), executor=executor)
    topo_nccl = [t.name for t in pipe.graph.order if t.nccl]
    assert topo_nccl == ["shuffle", "start_dist", "wait_dist", "tokens", "backward", "finalize"]
    run_all(pipe, range(12))
    assert sorted(issued) == list(range(14))
    for _i, names in issued.items():  # issue order == topological order of that iteration's nccl tasks
        assert names == [name for name in topo_nccl if name in names]
    assert executor.lock.history == list(range(len(issued[13])))  # the last iteration's tickets
    pipe.shutdown()


def test_failure_wakes_a_waiter_blocked_on_the_nccl_lock():
    lock = NcclOrderedLock()
    errors = []

    def waiter():
        try:
            lock.acquire(1)
        except NcclLockAborted as exc:
            errors.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    lock.acquire(0)
    lock.release(failed=True)
    thread.join(5)
    assert not thread.is_alive() and len(errors) == 1


@given(
    specs=schedule_specs(max_tasks=5),
    m=st.integers(1, 5),
    fail_at=st.data(),
    thread_map=st.sampled_from(sorted(THREAD_MAPS)),
    nccl=st.booleans(),
)
@settings(max_examples=220, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_failure_injection_always_surfaces_and_never_hangs(specs, m, fail_at, thread_map, nccl):
    victim = fail_at.draw(st.sampled_from([s["name"] for s in specs]))
    batch = fail_at.draw(st.integers(0, m - 1))
    trace = Trace()

    def body(ctx):
        if ctx.task.name == victim and ctx.batch_index == batch:
            raise RuntimeError("injected")
        trace.body(ctx)

    tasks = [Task.from_fn(s["name"], body, nccl=nccl, **{k: v for k, v in s.items() if k != "name"}) for s in specs]
    schedule = Schedule(stages=(Stage(tuple(tasks)),), stream_slots=("default", "s1", "s2"))
    pipe = SchedulablePipeline(schedule, executor=ThreadedExecutor(THREAD_MAPS[thread_map]()))
    it = iter(range(m))
    start = time.monotonic()
    with pytest.raises(TaskFailedError) as info:
        run_all(pipe, it)
    assert (info.value.task, info.value.batch_index) == (victim, batch)
    assert isinstance(info.value.__cause__, RuntimeError) and str(info.value.__cause__) == "injected"
    with pytest.raises(PipelineBrokenError):
        pipe.progress(it)
    pipe.shutdown()
    assert time.monotonic() - start < 10


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
    pipe = SchedulablePipeline(Schedule.single_stage(tasks), executor=ThreadedExecutor("per_task"))
    with pytest.raises(TaskFailedError, match="task 'boom' failed on batch 0"):
        pipe.progress(iter(range(3)))
    assert ran == []
    pipe.shutdown()


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
    executor = ThreadedExecutor(thread_map, max_workers=max_workers)
    before = threading.active_count()
    ref, _, _ = traced_run(HAND_WRITTEN, "sequential", 6)
    trace = Trace()
    schedule = build(HAND_WRITTEN, trace)
    pipe = SchedulablePipeline(schedule, executor=executor)
    for _ in range(3):  # workers are long-lived: iterations create no threads
        run_all(pipe, range(6))
        assert executor.num_threads == expected
        assert threading.active_count() - before == expected
        assert trace.reads == ref.reads
        trace.reads.clear()
    pipe.shutdown()
    assert threading.active_count() == before


def test_shutdown_is_prompt_and_idempotent():
    pipe = SchedulablePipeline(build(HAND_WRITTEN, Trace()), executor="threaded")
    run_all(pipe, range(3))
    start = time.monotonic()
    pipe.shutdown()
    pipe.shutdown()
    assert time.monotonic() - start < 1
    with pytest.raises(PipelineBrokenError, match="shut down"):
        pipe.progress(iter(range(2)))
