"""Dependency math (ring offsets, Δ, event waits, topological order) and the validator rules."""

import pytest

from recsys_pipe.engine import (
    DataSlot,
    DependencyCycleError,
    EventWait,
    StreamPool,
    Task,
    TaskGraph,
    TaskGraphValidationError,
    TaskGroup,
    compile_dependencies,
)

STREAMS = ("default", "memcpy", "data_dist", "prefetch", "stats")


def t(name, **fields):
    return Task.from_fn(name, lambda ctx: None, **fields)


def sched(*tasks, streams=STREAMS):
    return TaskGraph(groups=(TaskGroup(tasks),), stream_slots=streams)


def problems_of(task_graph, pool=None):
    with pytest.raises(TaskGraphValidationError) as info:
        compile_dependencies(task_graph, pool)
    return info.value.problems


def order_of(task_graph):
    return [x.name for x in compile_dependencies(task_graph).order]


# -- worked examples: Δ and slot offset of cross_iter_depends_on -------------------------------------

CROSS_ITER_CASES = [
    # X.la, C.la, N, Δ, slot_offset, cross-stream ok, same-stream ok
    (0, 0, 1, 1, -1, False, True),
    (1, 1, 1, 1, 0, True, True),
    (2, 2, 2, 2, 0, True, True),
    (3, 2, 2, 3, 0, True, True),
    (0, 1, 1, 0, 0, True, True),  # Δ = 0: promoted to same_progress_sync
    (0, 3, 1, -2, 2, False, False),  # future read
]


@pytest.mark.parametrize("x_la, c_la, n, delta, slot_offset, cross_ok, same_ok", CROSS_ITER_CASES)
@pytest.mark.parametrize("cross_stream", [True, False])
def test_cross_iter_worked_examples(x_la, c_la, n, delta, slot_offset, cross_ok, same_ok, cross_stream):
    x = t("X", lookahead=x_la, stream="memcpy")
    c = t("C", lookahead=c_la, stream="default" if cross_stream else "memcpy", cross_iter_depends_on=[("X", -n)])
    ok = cross_ok if cross_stream else same_ok
    if not ok:
        (problem,) = problems_of(sched(x, c))
        assert (problem.task, problem.field, problem.index) == ("C", "cross_iter_depends_on", 0)
        assert ("future read" if delta < 0 else "rotated out of the ring") in problem.message
        return
    graph = compile_dependencies(sched(x, c))
    (dep,) = graph.dependencies
    assert (dep.delta, dep.slot_offset) == (delta, slot_offset)
    assert dep.in_iteration == (delta == 0)
    waits = graph.event_waits["C"]
    assert waits == ((EventWait("X", "memcpy", slot_offset),) if cross_stream else ())
    edge_kinds = [e.kind for e in graph.edges]
    assert edge_kinds == (["cross_iter(Δ=0)"] if delta == 0 else [])


def test_delta_zero_cross_iter_equals_same_progress_sync():
    update = t("update", lookahead=0)
    fwd_cross = t("forward", lookahead=1, stream="memcpy", cross_iter_depends_on=[("update", -1)])
    fwd_sync = t("forward", lookahead=1, stream="memcpy", same_progress_sync=["update"])
    a = compile_dependencies(sched(fwd_cross, update))
    b = compile_dependencies(sched(fwd_sync, update))
    assert [x.name for x in a.order] == [x.name for x in b.order] == ["update", "forward"]
    assert a.event_waits == b.event_waits
    assert a.event_waits["forward"] == (EventWait("update", "default", 0),)


def test_seed_section_3_6_ring_rotation_example():
    """Five HSTU prefetch-variant tasks plus a hypothetical aux_stats task on its own stream."""
    h2d = t("h2d", lookahead=2, stream="memcpy")
    start = t("start_input_dist", lookahead=1, stream="data_dist", depends_on=["h2d"])
    wait = t("wait_input_dist", lookahead=1, stream="data_dist", depends_on=["start_input_dist"])
    prefetch = t("prefetch_embeddings", lookahead=1, stream="prefetch", depends_on=["wait_input_dist"])
    forward = t("forward", lookahead=0, depends_on=["prefetch_embeddings"])
    backward = t("backward", lookahead=0, depends_on=["forward"], same_progress_sync=["prefetch_embeddings"])
    aux = t("aux_stats", lookahead=2, stream="stats", cross_iter_depends_on=[("h2d", -1)])
    graph = compile_dependencies(sched(forward, backward, aux, h2d, start, wait, prefetch))
    waits = graph.event_waits
    assert waits["forward"] == (EventWait("prefetch_embeddings", "prefetch", 0),)  # after one advance
    assert waits["backward"] == (EventWait("prefetch_embeddings", "prefetch", 1),)  # same progress
    assert waits["aux_stats"] == (EventWait("h2d", "memcpy", 1),)  # consumer.la - N
    assert waits["start_input_dist"] == (EventWait("h2d", "memcpy", 1),)
    assert waits["prefetch_embeddings"] == (EventWait("wait_input_dist", "data_dist", 1),)
    assert waits["wait_input_dist"] == waits["h2d"] == ()  # same stream / no producer
    order = [x.name for x in graph.order]
    # solid edges only: start -> wait -> prefetch -> backward, forward -> backward
    assert order.index("start_input_dist") < order.index("wait_input_dist") < order.index("prefetch_embeddings")
    assert order.index("prefetch_embeddings") < order.index("backward")
    assert {(e.producer, e.consumer) for e in graph.edges} == {
        ("start_input_dist", "wait_input_dist"),
        ("wait_input_dist", "prefetch_embeddings"),
        ("forward", "backward"),
        ("prefetch_embeddings", "backward"),
    }


def test_slot_read_offsets_and_topo_membership():
    h2d = t("h2d", lookahead=2, stream="memcpy", reads=["batch_cpu"], writes=["batch_gpu"])
    peek = t("peek", lookahead=2, stream="default", reads=["batch_gpu"])  # same offset: topo edge
    fwd = t("forward", lookahead=0, reads=["batch_gpu"], writes=["step_result"])  # ring-rotated
    graph = compile_dependencies(sched(fwd, peek, h2d))
    deps = {(d.consumer, d.producer): d for d in graph.dependencies}
    assert (deps["peek", "h2d"].delta, deps["peek", "h2d"].slot_offset) == (0, 2)
    assert (deps["forward", "h2d"].delta, deps["forward", "h2d"].slot_offset) == (2, 0)
    assert [x.name for x in graph.order] == ["forward", "h2d", "peek"]


def test_same_stream_edges_emit_no_wait():
    a = t("a", lookahead=1, writes=["x"])
    b = t("b", lookahead=0, reads=["x"], depends_on=["a"])
    assert compile_dependencies(sched(a, b)).event_waits["b"] == ()


def test_topological_sort_breaks_ties_by_declaration_order():
    a, b, c, d = t("a"), t("b", depends_on=["d"]), t("c"), t("d")
    assert order_of(sched(a, b, c, d)) == ["a", "c", "d", "b"]


def test_stages_run_in_order_and_edges_may_not_point_backwards():
    a, b = t("a"), t("b", depends_on=["a"])
    task_graph = TaskGraph(groups=(TaskGroup((b,)), TaskGroup((a,))), stream_slots=("default",))
    (problem,) = problems_of(task_graph)
    assert (problem.task, problem.field) == ("b", "depends_on") and "group 1" in problem.message
    ok = TaskGraph(groups=(TaskGroup((a,)), TaskGroup((b,))), stream_slots=("default",))
    assert order_of(ok) == ["a", "b"]


# -- validator rules: one failing and one passing case each --------------------------------------


def test_rule1_unique_names():
    (problem,) = problems_of(sched(t("a"), t("a")))
    assert problem.field == "name" and "unique" in problem.message
    compile_dependencies(sched(t("a"), t("b")))


def test_rule2_lookahead_and_offsets_nonnegative():
    bad = t("a")
    bad.lookahead = -1  # bypasses construction checks: the validator still catches it
    (problem,) = problems_of(sched(bad))
    assert problem.field == "lookahead"
    compile_dependencies(sched(t("a", lookahead=0, writes=[("x", 0)])))


def test_rule3_streams_declared_and_in_pool():
    (problem,) = problems_of(sched(t("a", stream="side"), streams=("default",)))
    assert problem.field == "stream" and "not declared" in problem.message
    pool = StreamPool.create(["default"])
    (problem,) = problems_of(sched(t("a", stream="memcpy")), pool)
    assert problem.field == "stream" and "not in the stream pool" in problem.message
    compile_dependencies(sched(t("a", stream="memcpy")), StreamPool.create(["default", "memcpy"]))


def test_rule4_one_writer_per_slot():
    (problem,) = problems_of(sched(t("a", writes=["x"]), t("b", writes=["x"])))
    assert (problem.task, problem.field, problem.index) == ("b", "writes", 0)
    assert "already written by 'a'" in problem.message
    compile_dependencies(sched(t("a", writes=["x"]), t("b", lookahead=1, writes=["x"])))


def test_rule5_reads_resolve_to_a_writer():
    (problem,) = problems_of(sched(t("a", reads=["y"])))
    assert (problem.field, problem.index) == ("reads", 0) and "no task writes slot 'y'" in problem.message
    (problem,) = problems_of(sched(t("w", writes=["x"]), t("r", lookahead=1, reads=["x"])))
    assert "future read" in problem.message
    compile_dependencies(sched(t("w", lookahead=1, writes=["x"]), t("r", reads=["x", "batch_cpu"])))


def test_rule6_dependency_names_exist():
    (problem,) = problems_of(sched(t("h2d"), t("forward", depends_on=["fwd"])))
    assert (problem.task, problem.field, problem.index) == ("forward", "depends_on", 0)
    assert problem.message == "unknown task 'fwd' (known: h2d, forward)"
    for field in ("cross_iter_depends_on", "same_progress_sync"):
        (problem,) = problems_of(sched(t("a", **{field: ["nope"]})))
        assert problem.field == field
    compile_dependencies(sched(t("h2d"), t("forward", depends_on=["h2d"])))


def test_rule7_acyclic_names_the_cycle():
    with pytest.raises(DependencyCycleError) as info:
        compile_dependencies(
            sched(t("a", depends_on=["c"]), t("b", depends_on=["a"]), t("c", same_progress_sync=["b"]), t("d"))
        )
    assert str(info.value.problems[0].message) == "cyclic dependency: a -> b -> c -> a"
    assert info.value.problems[0].task == "b" and info.value.problems[0].field == "depends_on"
    # the same declarations across lookaheads are ring-rotated, not a cycle
    compile_dependencies(
        sched(
            t("a", lookahead=0, depends_on=["b"]),
            t("b", lookahead=1, cross_iter_depends_on=["a"]),
            streams=("default",),
        )
    )


def test_rule8_one_wait_per_consumer_producer_pair():
    x = t("X", lookahead=1, stream="memcpy", writes=["x"])
    conflicting = t("C", lookahead=1, reads=[("x", 0)], depends_on=["X"])
    (problem,) = problems_of(sched(x, conflicting))
    assert "at most one cross-stream wait" in problem.message and problem.task == "C"
    agreeing = t("C", lookahead=1, reads=["x"], depends_on=["X"])
    assert compile_dependencies(sched(x, agreeing)).event_waits["C"] == (EventWait("X", "memcpy", 1),)


def test_depends_on_future_read_rejected():
    (problem,) = problems_of(sched(t("fwd", lookahead=0), t("prep", lookahead=1, depends_on=["fwd"])))
    assert (problem.task, problem.field) == ("prep", "depends_on") and "future read" in problem.message


def test_reserved_batch_cpu_cannot_be_written():
    (problem,) = problems_of(sched(t("a", writes=["batch_cpu"])))
    assert "reserved" in problem.message


def test_all_problems_are_reported_at_once():
    problems = problems_of(sched(t("a", stream="nope", depends_on=["ghost"]), t("b", reads=["missing"])))
    assert {(p.task, p.field) for p in problems} == {("a", "stream"), ("a", "depends_on"), ("b", "reads")}


def test_data_slot_equality():
    assert DataSlot("x", 1) == DataSlot("x", 1) != DataSlot("x", 2)
    assert len({DataSlot("x", 1), DataSlot("x", 1), DataSlot("y", 1)}) == 2


def test_cpu_edges_are_declared_edges_plus_same_stream_fifo():
    from recsys_pipe.engine import Edge, cpu_edges

    a, b = t("a", stream="memcpy"), t("b", depends_on=["a"])
    c, d = t("c", stream="memcpy"), t("d")
    graph = compile_dependencies(sched(a, b, c, d))
    assert cpu_edges(graph) == (
        Edge("a", "b", "depends_on"),
        Edge("a", "c", "stream_fifo"),
        Edge("b", "d", "stream_fifo"),
    )
    # restricted to the tasks that fire: FIFO links the previous *firing* task on the stream
    assert cpu_edges(graph, [a, c, d]) == (Edge("a", "c", "stream_fifo"),)
