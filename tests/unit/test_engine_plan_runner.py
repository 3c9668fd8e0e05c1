"""PlanRunner semantics: firing mask, ring flow, progress/drain, reset, observers."""

import logging

import pytest
from _task_graphs import Trace, build, task_graph_specs
from hypothesis import given, settings
from hypothesis import strategies as st

from recsys_pipe.engine import (
    BatchRing,
    PlanRunner,
    PlanRunnerBrokenError,
    StreamPool,
    Task,
    TaskFailedError,
    TaskGraph,
    TaskGroup,
    fires,
)
from recsys_pipe.engine.testing import check_happens_before, recording_pool


def three_level(log):
    """h2d (la 2, memcpy) -> dist (la 1, data_dist) -> train (la 0): the HSTU layout without prefetch."""

    def h2d(ctx):
        log.append((ctx.iter_count, "h2d", ctx.batch_index))
        ctx.slots.set("gpu", ("gpu", ctx.slots["batch_cpu"]))

    def dist(ctx):
        log.append((ctx.iter_count, "dist", ctx.batch_index))
        ctx.slots.set("dist", ("dist", ctx.slots["gpu"]))

    def train(ctx):
        log.append((ctx.iter_count, "train", ctx.batch_index))
        ctx.slots.set("step_result", ("trained", ctx.slots["dist"]))

    return TaskGraph.single_group(
        [
            Task.from_fn("train", train, reads=["dist"], writes=["step_result"]),
            Task.from_fn(
                "dist", dist, stream="data_dist", lookahead=1, reads=["gpu"], writes=["dist"], depends_on=["h2d"]
            ),
            Task.from_fn("h2d", h2d, stream="memcpy", lookahead=2, reads=["batch_cpu"], writes=["gpu"]),
        ]
    )


def test_batch_flows_through_a_three_level_ring():
    log = []
    with PlanRunner(three_level(log)) as runner:
        results = list(runner.iterate(range(4)))
    assert results == [("trained", ("dist", ("gpu", b))) for b in range(4)]


def test_prefill_steady_drain_pattern():
    """Prefill, steady state, drain: iteration i runs h2d on batch i, dist on i-1, train on i-2."""
    log = []
    m = 4
    runner = PlanRunner(three_level(log))
    it = iter(range(m))
    first = runner.progress(it)
    assert first[0] == "trained"
    assert [(i, name, b) for i, name, b in log] == [
        (0, "h2d", 0),  # prefill
        (1, "dist", 0),
        (1, "h2d", 1),  # prefill
        (2, "train", 0),
        (2, "dist", 1),
        (2, "h2d", 2),  # steady: progress #1 returns batch 0
    ]
    list(runner.iterate(it))
    by_iter = {}
    for i, name, b in log:
        by_iter.setdefault(i, []).append((name, b))
    assert by_iter[3] == [("train", 1), ("dist", 2), ("h2d", 3)]
    assert by_iter[4] == [("train", 2), ("dist", 3)]  # drain: iterator exhausted, no h2d
    assert by_iter[5] == [("train", 3)]
    assert max(by_iter) == 5


@given(lookaheads=st.lists(st.integers(0, 4), min_size=1, max_size=6), m=st.integers(0, 9))
@settings(max_examples=60, deadline=None)
def test_mask_matches_formula_and_every_batch_runs_once(lookaheads, m):
    seen = []

    def body(ctx):
        seen.append((ctx.task.name, ctx.batch_index, ctx.iter_count, ctx.slots["batch_cpu"]))

    tasks = [Task.from_fn(f"t{i}", body, lookahead=la, reads=["batch_cpu"]) for i, la in enumerate(lookaheads)]
    runner = PlanRunner(TaskGraph.single_group(tasks))
    results = list(runner.iterate([f"batch{b}" for b in range(m)]))
    assert len(results) == m
    L = max(lookaheads)
    for name, batch, i, payload in seen:
        la = lookaheads[int(name[1:])]
        assert fires(la, L, i, m) and batch == i - L + la
        assert payload == f"batch{batch}"  # each task saw its own batch's data
    assert sorted((n, b) for n, b, _, _ in seen) == sorted(
        (f"t{i}", b) for i in range(len(lookaheads)) for b in range(m)
    )


@given(specs=task_graph_specs(), m=st.integers(0, 7))
@settings(max_examples=80, deadline=None)
def test_random_schedules_no_batch_lost_and_data_from_right_producer(specs, m):
    trace = Trace()
    task_graph = build(specs, trace)
    pool, log = recording_pool(task_graph.stream_slots)
    with PlanRunner(task_graph, pool) as runner:
        results = list(runner.iterate(range(m)))
    assert len(results) == m
    assert sorted(trace.reads) == sorted((s["name"], b) for s in specs for b in range(m))
    assert check_happens_before(log, task_graph) == []
    from recsys_pipe.engine.testing import required_producers

    tasks = {t.name: t for t in task_graph.tasks}
    for (name, batch), seen in trace.reads.items():
        task = tasks[name]
        for slot, value in zip(task.reads, seen):
            if slot.name == "batch_cpu":
                assert value == batch - task.lookahead + slot.batch_offset
                continue
            producers = [
                (p, pb) for p, pb, why in required_producers(task_graph, task, batch) if why == f"reads {slot}"
            ]
            (producer,) = producers
            assert value == trace.writes.get(producer), f"{name}[{batch}] read {slot} from the wrong batch"


def test_happens_before_checker_catches_missing_waits():
    """Not vacuous: a backend that drops waits must be caught on a cross-stream task_graph."""
    trace = Trace()
    task_graph = build(
        [
            {"name": "a", "lookahead": 1, "stream": "s1", "writes": ["x"]},
            {"name": "b", "lookahead": 0, "stream": "default", "reads": ["x"], "writes": ["step_result"]},
        ],
        trace,
    )
    pool, log = recording_pool(task_graph.stream_slots, drop_waits=True)
    list(PlanRunner(task_graph, pool).iterate(range(3)))
    violations = check_happens_before(log, task_graph)
    assert len(violations) == 3 and "b[batch 0] (reads x@0) is not ordered after a[batch 0]" in violations[0]


def test_new_iterator_resets_and_drops_stale_batches(caplog):
    log = []
    runner = PlanRunner(three_level(log))
    train = iter(range(100, 110))
    assert runner.progress(train)[1][1][1] == 100
    assert runner.progress(train)[1][1][1] == 101
    with caplog.at_level(logging.WARNING):
        evaluation = iter(range(200, 203))
        assert [r[1][1][1] for r in runner.iterate(evaluation)] == [200, 201, 202]
    assert "dropping 2 in-flight batch(es)" in caplog.text
    trained = [b for _, name, b in log if name == "train"]
    assert trained == [0, 1, 0, 1, 2]  # batch indices restart with the new iterator
    with pytest.raises(StopIteration):
        runner.progress(evaluation)  # still exhausted: no restart for the same object


def test_step_and_drain_push_mode():
    log = []
    runner = PlanRunner(three_level(log))
    assert [runner.step(b) for b in range(4)] == [
        None,
        None,
        ("trained", ("dist", ("gpu", 0))),
        ("trained", ("dist", ("gpu", 1))),
    ]
    assert runner.drain() == [("trained", ("dist", ("gpu", 2))), ("trained", ("dist", ("gpu", 3)))]
    assert runner.drain() == []


def test_lookahead_zero_step_returns_its_own_result():
    runner = PlanRunner(
        TaskGraph.single_group(
            [
                Task.from_fn(
                    "double",
                    lambda ctx: ctx.slots.set("step_result", 2 * ctx.slots["batch_cpu"]),
                    reads=["batch_cpu"],
                    writes=["step_result"],
                )
            ]
        )
    )
    assert [runner.step(x) for x in (1, 2, 3)] == [2, 4, 6]


def test_failure_names_task_and_batch_and_breaks_the_runner():
    def boom(ctx):
        if ctx.batch_index == 2:
            raise ValueError("bad batch")

    runner = PlanRunner(TaskGraph.single_group([Task.from_fn("fwd", boom, lookahead=1)]))
    it = iter(range(5))
    runner.progress(it)
    with pytest.raises(TaskFailedError, match="task 'fwd' failed on batch 2") as info:
        list(runner.iterate(it))
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(PlanRunnerBrokenError, match="stopped after a failure"):
        runner.progress(it)


def test_init_runs_once_per_task_before_first_iteration():
    calls = []

    class Counted(Task):
        name = "counted"

        def init(self, ctx):
            calls.append(("init", ctx.state))

        def run(self, ctx):
            calls.append(("run", ctx.batch_index))

    runner = PlanRunner(TaskGraph(groups=(TaskGroup((Counted(),)),)), state="shared")
    list(runner.iterate(range(2)))
    assert calls == [("init", "shared"), ("run", 0), ("run", 1)]


def test_ring_rotation():
    ring = BatchRing(3)
    for k in range(3):
        ring.at(k).set("b", k)
    ring.advance()
    assert [ring.at(k).get("b") for k in range(3)] == [1, 2, None]
    with pytest.raises(IndexError):
        ring.at(3)
    with pytest.raises(KeyError, match="slot 'b' is empty"):
        ring.at(2)["b"]


def test_seed_first_batch_trains_the_peeked_batch_once():
    log = []
    runner = PlanRunner(three_level(log))
    it = iter(range(5))
    peek = next(it)
    runner.seed_first_batch(it, {"batch_cpu": peek, "prepared_by": "bootstrap"})
    assert runner.ring.at(2)["prepared_by"] == "bootstrap"
    results = list(runner.iterate(it))
    assert [r[1][1][1] for r in results] == [0, 1, 2, 3, 4]
    assert [b for _, name, b in log if name == "train"] == [0, 1, 2, 3, 4]
    assert sorted(b for _, name, b in log if name == "h2d") == [0, 1, 2, 3, 4]


def test_iterate_yields_every_result_and_can_stop_early():
    log = []
    runner = PlanRunner(three_level(log))
    assert [r[1][1][1] for r in runner.iterate([10, 11, 12])] == [10, 11, 12]  # any iterable
    it = iter(range(6))
    seen = []
    for result in runner.iterate(it):
        seen.append(result[1][1][1])
        if len(seen) == 2:
            break  # abandoned: batches 2 and 3 are in flight
    assert seen == [0, 1] and runner.in_flight == 2
    assert runner.progress(it)[1][1][1] == 2  # the same iterator carries on where it stopped
    assert [r[1][1][1] for r in runner.iterate(it)] == [3, 4, 5]
    assert list(runner.iterate(it)) == []  # exhausted and drained
    assert [b for _, name, b in log if name == "train"] == [0, 1, 2, 0, 1, 2, 3, 4, 5]


def test_no_op_pools_skip_stream_work_and_recording_pools_do_not():
    """No-op streams order nothing, so the engine records no completion events for them."""
    assert StreamPool.create(["default", "memcpy"]).is_noop
    task_graph = three_level([])
    recording, _ = recording_pool(task_graph.stream_slots)
    assert not recording.is_noop
    for pool, recorded in ((StreamPool.create(task_graph.stream_slots), False), (recording, True)):
        runner = PlanRunner(task_graph, pool)
        it = iter(range(5))
        runner.progress(it)
        events = [runner.ring.at(k).event(name) for k, name in ((0, "h2d"), (1, "h2d"), (0, "dist"))]
        assert all(e is not None for e in events) if recorded else events == [None, None, None]


def test_a_precompiled_graph_is_used_as_is_and_its_streams_checked():
    from recsys_pipe.engine import StreamPool, TaskGraphValidationError, compile_dependencies

    task_graph = TaskGraph.single_group(
        [
            Task.from_fn(
                "prep",
                lambda ctx: ctx.slots.set("x", ctx.slots["batch_cpu"]),
                stream="side",
                lookahead=1,
                reads=["batch_cpu"],
                writes=["x"],
            ),
            Task.from_fn(
                "step",
                lambda ctx: ctx.slots.set("step_result", ctx.slots["x"] * 2),
                reads=["x"],
                writes=["step_result"],
            ),
        ]
    )
    graph = compile_dependencies(task_graph)
    with PlanRunner(graph, StreamPool.create(["default", "side"])) as runner:
        assert runner.graph is graph
        assert list(runner.iterate(range(4))) == [0, 2, 4, 6]
    with pytest.raises(TaskGraphValidationError, match="stream 'side' is not in the stream pool"):
        PlanRunner(graph, StreamPool.create(["default"]))
