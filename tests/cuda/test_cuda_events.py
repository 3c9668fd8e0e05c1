"""Event sync on real CUDA streams: every dependency kind, sequential and threaded executors,
hand-written and random plans; with one wait removed, the race shows.

A producer spins for a long time before writing its output; a consumer on another stream copies
that output first thing. Only the engine's event wait (or, before any event exists, its
`wait_stream` fallback) keeps the copy behind the write. Every test also checks that each wait
was on exactly the event the producer recorded for the right batch, found where the ring has
rotated it to (`wait_violations`).
"""

import pytest
import torch
from _streams import DEPENDENCY_KINDS as KINDS
from _streams import DeviceTrace, EventLogPool, wait_violations
from _task_graphs import STREAMS, task_graph_specs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsys_pipe.engine import PlanRunner, ThreadedExecutor

pytestmark = pytest.mark.timeout(300)

LONG_MS = 20.0  # the producer's spin: far longer than the host needs to submit a whole test
BATCHES = 6
EXECUTORS = {
    "sequential": lambda: "sequential",
    "by_stream": lambda: ThreadedExecutor("by_stream"),
    "per_task": lambda: ThreadedExecutor("per_task"),
}


def run(task_graph, executor, pool, batches=BATCHES):
    """Train `batches` batches (the bodies ignore the payload); return the plan runner."""
    with PlanRunner(task_graph, pool, executor) as runner:
        assert len(list(runner.iterate(range(batches)))) == batches
        return runner


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_dependency_kind_reads_its_producers_value_for_the_right_batch(kind, executor):
    specs, edge_kind, delta = KINDS[kind]
    trace = DeviceTrace(delay_ms={"X": LONG_MS})
    pool = EventLogPool.cuda(STREAMS)
    runner = run(trace.build(specs, STREAMS), EXECUTORS[executor](), pool)
    (dependency,) = [d for d in runner.graph.dependencies if d.consumer == "C"]
    assert (dependency.edge_kind, dependency.delta) == (edge_kind, delta)  # the plan tests what it says
    assert trace.violations() == []
    assert wait_violations(runner, pool, trace.ran, BATCHES) == []
    # Not vacuous: all batches but at most one (before the first / after the last) read X's
    # output, and each of those reads was ordered by one of X's events.
    assert len(trace.reads) >= BATCHES - 1
    event_waits = [w for (name, _), waits in pool.waits.items() if name == "C" for w in waits if w[0] == "event"]
    assert len(event_waits) == len(trace.reads)


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_without_the_consumers_wait_the_race_shows(kind, executor):
    """The same runs with the consumer stream's waits left out: its copies overtake the producer's
    writes. (This is what makes the test above able to fail.)"""
    specs, _, _ = KINDS[kind]
    consumer_stream = specs[1]["stream"]
    trace = DeviceTrace(delay_ms={"X": LONG_MS})
    pool = EventLogPool.cuda(STREAMS, drop_waits_of=consumer_stream)
    run(trace.build(specs, STREAMS), EXECUTORS[executor](), pool)
    assert pool.dropped > 0
    violations = trace.violations()
    assert any("before it was written" in v for v in violations), violations


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
@pytest.mark.parametrize("dropped", [False, True], ids=["intact", "fallback_dropped"])
def test_prefill_fallback_orders_after_earlier_work_on_the_producers_stream(executor, dropped):
    """C (lookahead 1) needs X's output of the previous batch. For batch 0 that is work the caller
    put on X's stream before the first iteration: no event of X exists yet, so the engine makes C's
    stream wait for X's whole stream. From batch 1 on it waits for X's recorded events."""
    specs, _, _ = KINDS["cross_iter_delta_1"]
    trace = DeviceTrace(delay_ms={"X": LONG_MS})
    pool = EventLogPool.cuda(STREAMS, drop_waits_of="s2" if dropped else None, drop_kinds=("stream",))
    task_graph = trace.build(specs, STREAMS)
    with torch.cuda.stream(pool.get("s1")):
        trace.preset("X", -1, LONG_MS)  # the batch before batch 0, produced before the plan runner starts
    runner = run(task_graph, EXECUTORS[executor](), pool)
    assert pool.waits[("C", 0)] == [("stream", "s1")]
    assert all([kind for kind, _ in pool.waits[("C", b)]] == ["event"] for b in range(1, BATCHES))
    assert wait_violations(runner, pool, trace.ran, BATCHES) == []
    violations = trace.violations()
    if dropped:
        assert pool.dropped == 1
        assert len(violations) == 1 and violations[0].startswith("C[batch 0] ") and "X[batch -1]" in violations[0]
    else:
        assert violations == []


@given(
    specs=task_graph_specs(),
    batches=st.integers(1, 6),
    executor=st.sampled_from([*sorted(EXECUTORS), "random_threads"]),
    data=st.data(),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_plans_read_every_producer_after_it_wrote(specs, batches, executor, data):
    names = [s["name"] for s in specs]
    delays = {name: data.draw(st.sampled_from([0.0, 0.3, 2.0]), label=f"delay_ms[{name}]") for name in names}
    if executor == "random_threads":  # any split of the tasks over up to 3 threads
        chosen = ThreadedExecutor({name: f"w{data.draw(st.integers(0, 2))}" for name in names})
    else:
        chosen = EXECUTORS[executor]()
    trace = DeviceTrace(delay_ms=delays)
    pool = EventLogPool.cuda(STREAMS)
    runner = run(trace.build(specs, STREAMS), chosen, pool, batches)
    assert sorted(trace.ran) == sorted((name, b) for name in names for b in range(batches))
    assert trace.violations() == []
    assert wait_violations(runner, pool, trace.ran, batches) == []
