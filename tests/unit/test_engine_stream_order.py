"""The engine's stream work per task, cut: waits that stream order implies are skipped in the
steady state (`recsys_pipe.engine.stream_order`), completion events are recorded again into the
event object of their ring position, and a thread enters a stream once per run of its tasks on
it. Every run is checked with the happens-before checker on recording streams (every declared
dependency of every task instance ordered), sequential and threaded, and against the waits the
ring layout prescribes (`wait_violations`)."""

import threading

import pytest
from _streams import EventLogPool, wait_violations
from _task_graphs import STREAMS, Trace, build, task_graph_specs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsys_pipe.engine import PlanRunner, Task, TaskGraph, TaskGroup, ThreadedExecutor, compile_dependencies
from recsys_pipe.engine.stream_order import ImpliedWaits, implied_waits
from recsys_pipe.engine.testing import RecordingStream, StreamLog, check_happens_before

pytestmark = pytest.mark.timeout(120)

EXECUTORS = {
    "sequential": lambda: "sequential",
    "by_stream": lambda: ThreadedExecutor("by_stream"),
    "per_task": lambda: ThreadedExecutor("per_task"),
}

#: torchrec's PrefetchTrainPipelineSparseDist layout, as conf/pipeline/prefetch.yaml declares it
PREFETCH = [
    {"name": "h2d", "lookahead": 2, "stream": "memcpy", "reads": ["batch_cpu"], "writes": ["batch_gpu"]},
    {"name": "start_input_dist", "lookahead": 1, "stream": "data_dist", "reads": ["batch_gpu"], "writes": ["splits"]},
    {"name": "wait_input_dist", "lookahead": 1, "stream": "data_dist", "reads": ["splits"], "writes": ["dist"]},
    {"name": "zero_grad", "lookahead": 0},
    {
        "name": "forward",
        "lookahead": 0,
        "reads": ["batch_gpu", "prefetched"],
        "writes": ["loss"],
        "depends_on": ["zero_grad"],
    },
    {
        "name": "prefetch_embeddings",
        "lookahead": 1,
        "stream": "prefetch",
        "reads": ["dist"],
        "writes": ["prefetched"],
        "same_progress_sync": ["forward"],
    },
    {"name": "backward", "lookahead": 0, "reads": ["loss"], "same_progress_sync": ["prefetch_embeddings"]},
    {"name": "optimizer_step", "lookahead": 0, "reads": ["loss", "batch_gpu"], "writes": ["step_result"]},
]
PREFETCH_STREAMS = ("default", "memcpy", "data_dist", "prefetch")


class Quiet:
    """Task bodies that do nothing (the stream work is the engine's)."""

    @staticmethod
    def body(ctx):
        pass


def traced(specs, executor, batches, streams=STREAMS, implied=None):
    trace = Trace()
    task_graph = build(specs, trace, streams)
    pool, log = EventLogPool.recording(streams)
    with PlanRunner(task_graph, pool, executor) as runner:
        if implied is not None:
            _force_implied(runner, implied)
        assert len(list(runner.iterate(range(batches)))) == batches
    return runner, pool, trace, check_happens_before(log, task_graph)


def _force_implied(runner, implied):
    """Make `runner` skip other waits than the analysis found (standing for a wrong analysis)."""
    runner.implied = implied
    for record in runner._records.values():
        record.steady_waits = tuple(
            record.waits[w] for w in implied.kept(runner.graph, record.name) if w < len(record.waits)
        )


def waits_of(pool, task, batch):
    return [pool_wait[0] for pool_wait in pool.waits[(task, batch)]]


def test_the_prefetch_layout_skips_the_waits_stream_order_implies():
    """forward's waits on h2d and on prefetch_embeddings, and optimizer_step's on h2d, are implied:
    the previous iteration's backward waited on the same prefetch event, whose stream had waited on
    the input dist, which had waited on h2d. backward's and the input dist's waits are not."""
    trace = Trace()
    graph = PlanRunner(build(PREFETCH, trace, PREFETCH_STREAMS)).graph
    found = implied_waits(graph)
    named = sorted((name, graph.event_waits[name][w].producer) for name, w in found.implied)
    assert named == [("forward", "h2d"), ("forward", "prefetch_embeddings"), ("optimizer_step", "h2d")]
    assert found.from_iteration == 3  # L = 2: the first full iteration still waits in full


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_the_prefetch_layout_stays_ordered_with_the_implied_waits_skipped(executor):
    batches = 12
    runner, pool, trace, violations = traced(PREFETCH, EXECUTORS[executor](), batches, PREFETCH_STREAMS)
    assert violations == []
    assert wait_violations(runner, pool, list(trace.reads), batches) == []
    # batch 0 is trained in iteration 2 (full waits), batch 1 in iteration 3 (steady: skipped)
    assert len(waits_of(pool, "forward", 0)) == 2 and waits_of(pool, "forward", 1) == []
    assert waits_of(pool, "optimizer_step", 0) == ["event"] and waits_of(pool, "optimizer_step", 1) == []
    assert all(waits_of(pool, "backward", b) == ["event"] for b in range(batches - 1))  # the last: drain


def test_skipping_a_wait_that_is_not_implied_breaks_the_order():
    """Not vacuous: a wrong analysis that also skips forward's wait in the sparse_dist layout (the
    input dist's result, which nothing else orders) is caught by the checker."""
    specs = [
        {"name": "h2d", "lookahead": 2, "stream": "memcpy", "reads": ["batch_cpu"], "writes": ["batch_gpu"]},
        {"name": "dist", "lookahead": 1, "stream": "data_dist", "reads": ["batch_gpu"], "writes": ["tensors"]},
        {"name": "forward", "lookahead": 0, "reads": ["batch_gpu", "tensors"], "writes": ["step_result"]},
    ]
    streams = ("default", "memcpy", "data_dist")
    runner, pool, trace, violations = traced(specs, "sequential", 8, streams)
    assert violations == [] and [w.producer for w in runner.graph.event_waits["forward"]] == ["h2d", "dist"]
    assert runner.implied.implied == {("forward", 0)}  # h2d's wait only
    everything = ImpliedWaits(frozenset({("forward", 0), ("forward", 1)}), runner.implied.from_iteration)
    _, _, _, violations = traced(specs, "sequential", 8, streams, implied=everything)
    assert any(v.startswith("forward[batch") and "after dist[batch" in v for v in violations), violations


@given(
    specs=task_graph_specs(),
    batches=st.integers(0, 16),
    executor=st.sampled_from([*sorted(EXECUTORS), "random_threads"]),
    data=st.data(),
)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_plans_stay_ordered_with_the_implied_waits_skipped(specs, batches, executor, data):
    """Long enough runs that the steady state skips: every dependency still ordered, every wait
    the one the ring layout and the analysis prescribe, threaded as sequential."""
    if executor == "random_threads":
        chosen = ThreadedExecutor({s["name"]: f"w{data.draw(st.integers(0, 2))}" for s in specs})
    else:
        chosen = EXECUTORS[executor]()
    runner, pool, trace, violations = traced(specs, chosen, batches)
    assert violations == []
    assert wait_violations(runner, pool, list(trace.reads), batches) == []


def test_random_plans_do_skip_waits():
    """The property above is not vacuous: over the first hundred generated plans, some skip."""
    skipped = []

    @given(specs=task_graph_specs())
    @settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    def count(specs):
        skipped.append(len(implied_waits(compile_dependencies(build(specs, Trace()))).implied))

    count()
    assert sum(n > 0 for n in skipped) >= 5, skipped


@pytest.mark.parametrize("how", ["short", "reset", "push"])
def test_only_the_replayed_schedule_skips(how):
    """A run whose iterator ends in the prefill never skips; a new iterator starts the prefill
    over and waits in full until the steady state; pushing batches one by one skips as pulling."""
    pool, log = EventLogPool.recording(PREFETCH_STREAMS)
    task_graph = build(PREFETCH, Quiet(), PREFETCH_STREAMS)  # the reset runs batch 0 twice
    with PlanRunner(task_graph, pool) as runner:
        if how == "short":
            assert len(list(runner.iterate(range(2)))) == 2
            assert all(len(waits_of(pool, "forward", b)) == 2 for b in range(2))
        elif how == "reset":
            first = iter(range(10))
            for _ in range(4):
                runner.progress(first)
            assert waits_of(pool, "forward", 3) == []  # steady: skipped
            mark = len(log.ops)
            list(runner.iterate(range(6)))  # a new iterator: the in-flight batches are dropped
            assert len(pool.waits[("forward", 0)]) == 2 and waits_of(pool, "forward", 3) == []
            log.ops = log.ops[mark:]  # the second run alone (its labels repeat the first's)
        else:
            for b in range(8):
                runner.step(b)
            runner.drain()
            assert sorted(b for name, b in pool.waits if name == "forward") == list(range(8))
            assert waits_of(pool, "forward", 0) != [] and waits_of(pool, "forward", 2) == []
    assert check_happens_before(log, task_graph) == []


def test_event_objects_are_recorded_again_not_made_per_task():
    """One event object per producer and ring position: over 30 batches, h2d's events (read by
    two streams) are 3 objects, recorded 30 times."""
    batches = 30
    runner, pool, trace, violations = traced(PREFETCH, "sequential", batches, PREFETCH_STREAMS)
    assert violations == []
    h2d = [pool.recorded[("h2d", b)] for b in range(batches)]
    assert len({id(event) for event, _ in h2d}) == runner.max_lookahead + 1
    assert sorted(count for _, count in h2d)[-1] == batches // (runner.max_lookahead + 1)


class CountingPool(EventLogPool):
    """Recording streams that count `enter` calls (stream switches), per thread."""

    def __init__(self, streams):
        super().__init__(streams)
        self.entered = []

    def enter(self, name):
        with self._lock:
            self.entered.append((threading.get_ident(), name))
        super().enter(name)


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_every_task_runs_on_its_stream_and_the_caller_gets_its_stream_back(executor):
    """Tasks see their own stream current (entered once per run of a thread's tasks on it, not
    per task), and after each iteration the calling thread is on the stream it started on."""
    log = StreamLog()
    pool = CountingPool({n: RecordingStream(n, log) for n in PREFETCH_STREAMS})
    wrong, lock = [], threading.Lock()

    def body(ctx):
        if ctx.stream_pool.current_name() != ctx.task.stream:
            with lock:
                wrong.append((ctx.task.name, ctx.stream_pool.current_name()))

    tasks = [Task.from_fn(s["name"], body, **{k: v for k, v in s.items() if k != "name"}) for s in PREFETCH]
    task_graph = TaskGraph(groups=(TaskGroup(tuple(tasks)),), stream_slots=PREFETCH_STREAMS)
    pool.enter("memcpy")  # the caller works on a stream of its own choosing
    pool.entered.clear()
    with PlanRunner(task_graph, pool, EXECUTORS[executor]()) as runner:
        for _ in runner.iterate(range(10)):
            assert pool.current_name() == "memcpy"
    assert wrong == []
    assert check_happens_before(log, task_graph) == []
    iterations = 10 + runner.max_lookahead
    if executor == "sequential":
        # one thread; a full iteration enters data_dist, default, prefetch, default (h2d finds memcpy
        # current): 2 in the second prefill iteration, 4 in each of 9 more, 1 in the last
        assert len(pool.entered) == 2 + 4 * 9 + 1
    else:
        assert len(pool.entered) < len(tasks) * iterations  # not once per task
