"""Which event each task instance waits on, on recording streams (CPU): the event its producer
recorded for the right batch after the ring rotated it, or the producer's whole stream when no
such event exists (the prefill fallback). tests/cuda/test_cuda_events.py checks the same on real
CUDA streams, with device reads that a missing wait would break; the bookkeeping of those reads
(`DeviceTrace`) is checked here on CPU tensors.
"""

import pytest
from _streams import DEPENDENCY_KINDS, DeviceTrace, EventLogPool, wait_violations
from _task_graphs import STREAMS, Trace, build, task_graph_specs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsys_pipe.engine import PlanRunner, ThreadedExecutor
from recsys_pipe.engine.testing import check_happens_before

pytestmark = pytest.mark.timeout(120)

EXECUTORS = {
    "sequential": lambda: "sequential",
    "by_stream": lambda: ThreadedExecutor("by_stream"),
    "per_task": lambda: ThreadedExecutor("per_task"),
}


def traced(specs, executor, batches):
    trace = Trace()
    task_graph = build(specs, trace, STREAMS)
    pool, log = EventLogPool.recording(STREAMS)
    with PlanRunner(task_graph, pool, executor) as runner:
        assert len(list(runner.iterate(range(batches)))) == batches
    return runner, pool, list(trace.reads), check_happens_before(log, task_graph)


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
@pytest.mark.parametrize("kind", sorted(DEPENDENCY_KINDS))
def test_each_kind_waits_on_the_event_of_the_right_batch(kind, executor):
    specs, edge_kind, delta = DEPENDENCY_KINDS[kind]
    runner, pool, ran, happens_before = traced(specs, EXECUTORS[executor](), 6)
    (dependency,) = [d for d in runner.graph.dependencies if d.consumer == "C"]
    assert (dependency.edge_kind, dependency.delta) == (edge_kind, delta)
    assert happens_before == []
    assert wait_violations(runner, pool, ran, 6) == []
    kinds = [[k for k, _ in pool.waits[("C", b)]] for b in range(6)]
    assert kinds.count(["event"]) >= 5 and set(map(tuple, kinds)) <= {("event",), ("stream",)}


def test_prefill_fallback_is_a_wait_for_the_producers_stream():
    """C needs X's previous batch: for batch 0 no event of X exists, so C's stream waits for X's
    stream; from batch 1 on, for the event X recorded one iteration earlier."""
    specs, _, _ = DEPENDENCY_KINDS["cross_iter_delta_1"]
    runner, pool, ran, _ = traced(specs, "sequential", 4)
    assert pool.waits[("C", 0)] == [("stream", "s1")]
    for b in range(1, 4):
        assert pool.waits[("C", b)] == [("event", pool.recorded[("X", b - 1)])]


def test_wait_check_catches_a_wait_on_the_wrong_batch():
    """Not vacuous: shifting every recorded event by one batch breaks the check."""
    specs, _, _ = DEPENDENCY_KINDS["depends_on_across_lookaheads"]
    runner, pool, ran, _ = traced(specs, "sequential", 4)
    pool.recorded = {(name, b + 1): event for (name, b), event in pool.recorded.items()}
    problems = wait_violations(runner, pool, ran, 4)
    assert problems and problems[0].startswith("C[batch ") and "expected" in problems[0]


@given(specs=task_graph_specs(), batches=st.integers(0, 6), executor=st.sampled_from(sorted(EXECUTORS)))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_plans_wait_on_the_event_of_the_right_batch(specs, batches, executor):
    runner, pool, ran, happens_before = traced(specs, EXECUTORS[executor](), batches)
    assert happens_before == []
    assert wait_violations(runner, pool, ran, batches) == []


@given(specs=task_graph_specs(), batches=st.integers(0, 6), executor=st.sampled_from(sorted(EXECUTORS)))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_device_trace_bookkeeping_on_cpu(specs, batches, executor):
    """The CUDA tests' task body on CPU tensors, where every read is in order: it must find every
    producer instance it needs (or know it never runs) and report nothing."""
    trace = DeviceTrace(device="cpu", size=4)
    task_graph = trace.build(specs, STREAMS)
    pool, _ = EventLogPool.recording(STREAMS)
    with PlanRunner(task_graph, pool, EXECUTORS[executor]()) as runner:
        list(runner.iterate(range(batches)))
    assert sorted(trace.ran) == sorted((s["name"], b) for s in specs for b in range(batches))
    assert trace.violations() == []
    assert wait_violations(runner, pool, trace.ran, batches) == []


def test_device_trace_reports_a_read_that_saw_an_unwritten_output():
    specs, _, _ = DEPENDENCY_KINDS["slot_read_next_batch"]
    trace = DeviceTrace(device="cpu", size=4)
    list(PlanRunner(trace.build(specs, STREAMS)).iterate(range(3)))
    assert trace.violations() == [] and len(trace.reads) == 3
    trace.reads[1][-1].fill_(-1)  # what a copy racing ahead of X's write would have seen
    assert trace.violations() == [
        "C[batch 1] (reads x@0) read X[batch 1] before it was written: saw unwritten (-1) instead of 1"
    ]
