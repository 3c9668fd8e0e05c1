"""Plan simulator: hand-computable plans with exact timings, and invariants over random plans."""

from __future__ import annotations

import math

import pytest
from _task_graphs import Trace, build, task_graph_specs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsys_pipe.autosched import CostModel, TaskCost, simulate
from recsys_pipe.engine import DataSlot, Task, TaskGraph, TaskGroup, compile_dependencies, fires


def noop(ctx):
    pass


def plan(*tasks: Task) -> TaskGraph:
    return TaskGraph.single_group(tasks)


def T(name: str, **fields) -> Task:
    return Task.from_fn(name, noop, **fields)


def costs(**entries) -> CostModel:
    return CostModel({name: c if isinstance(c, TaskCost) else TaskCost(*c) for name, c in entries.items()})


def span(result, task, batch, resource_prefix):
    found = [s for s in result.spans if s.task == task and s.batch == batch and s.resource.startswith(resource_prefix)]
    assert len(found) == 1, found
    return found[0]


def test_serial_chain_on_one_thread_is_the_sum_of_host_times():
    p = plan(T("a", writes=["x"]), T("b", reads=["x"], writes=["y"]), T("c", reads=["y"], writes=["step_result"]))
    r = simulate(p, costs(a=(1.0,), b=(2.0,), c=(3.0,)))
    assert r.iteration_s == 6.0
    assert r.completions == tuple(6.0 * (k + 1) for k in range(12))
    assert [(s.start, s.end) for s in r.spans if s.batch == 0 and s.resource == "thread:main"] == [
        (0.0, 1.0),
        (1.0, 3.0),
        (3.0, 6.0),
    ]
    assert r.utilisation["thread:main"] == 1.0
    assert [c.task for c in r.critical_path][-3:] == ["a", "b", "c"]


def test_two_threads_overlap_until_the_iteration_barrier():
    # thread A: a (3) then c (1); thread B: b (5). A is idle from 4 to 5: the barrier holds it.
    # (b has its own stream: on a's stream, same-stream FIFO would order it after a.)
    p = plan(T("a"), T("b", stream="s1"), T("c", writes=["step_result"]))
    r = simulate(p, costs(a=(3.0,), b=(5.0,), c=(1.0,)), thread_map={"b": "B", "default": "A"})
    assert r.iteration_s == 5.0
    assert [span(r, "a", k, "thread").start for k in range(4)] == [0.0, 5.0, 10.0, 15.0]
    assert span(r, "c", 2, "thread").end == 14.0
    assert r.busy_per_iteration == {"thread:A": 4.0, "thread:B": 5.0, "stream:default": 0.0, "stream:s1": 0.0}
    assert r.utilisation["thread:A"] == 0.8
    assert [(c.task, c.batch, c.reason) for c in r.critical_path] == [
        ("b", 10, "barrier"),
        ("(barrier)", None, "barrier"),
        ("b", 11, "barrier"),
    ]


def test_time_outside_tasks_is_in_series_with_every_iteration():
    # the two-thread plan above (5 per step) plus 0.5 outside tasks per iteration: 5.5, and the
    # outside span is on the critical path between the barrier and the next iteration's tasks
    p = plan(T("a"), T("b", stream="s1"), T("c", writes=["step_result"]))
    model = CostModel(costs(a=(3.0,), b=(5.0,), c=(1.0,)).tasks, outside_tasks_s=0.5)
    r = simulate(p, model, thread_map={"b": "B", "default": "A"})
    assert r.iteration_s == 5.5
    assert [span(r, "a", k, "thread").start for k in range(3)] == [0.5, 6.0, 11.5]
    assert "(outside tasks)" in [c.task for c in r.critical_path]
    assert all(s.task != "(outside tasks)" for s in r.spans)  # holds no resource
    assert r.busy_per_iteration["thread:B"] == 5.0


def test_mean_statistic_plays_the_means_where_known():
    p = plan(T("a", writes=["x"]), T("b", reads=["x"], writes=["step_result"]))
    model = CostModel(
        {"a": TaskCost(1.0, cpu_mean_s=1.5), "b": TaskCost(2.0)},  # b has no mean: its median is used
        outside_tasks_s=0.25,
        outside_tasks_mean_s=0.75,
    )
    assert simulate(p, model).iteration_s == 3.25
    assert simulate(p, model, statistic="mean").iteration_s == 4.25
    with pytest.raises(ValueError, match="statistic must be"):
        simulate(p, model, statistic="p90")


def test_in_iteration_dependency_across_threads_is_a_cpu_edge():
    p = plan(T("a", writes=["x"]), T("b", reads=["x"], writes=["step_result"]))
    r = simulate(p, costs(a=(3.0,), b=(5.0,)), thread_map="per_task")
    assert r.iteration_s == 8.0
    b0 = span(r, "b", 0, "thread")
    assert (b0.start, b0.end) == (3.0, 8.0)
    assert r.critical_path[-1].reason == "cpu edge (slot) from a"


def test_event_wait_uses_the_producer_run_the_ring_holds():
    # a (lookahead 1) prepares batch K+1 on stream s1 while b trains batch K on the default
    # stream; b's device work waits for a's event on *its* batch, recorded one iteration earlier.
    p = plan(
        T("a", stream="s1", lookahead=1, writes=["x"]),
        T("b", reads=["x"], writes=["step_result"]),
    )
    r = simulate(p, costs(a=(1.0, 4.0), b=(1.0, 2.0)))
    a0, a1 = span(r, "a", 0, "stream"), span(r, "a", 1, "stream")
    assert (a0.start, a0.end, a1.start, a1.end) == (0.0, 4.0, 4.0, 8.0)
    b0, b1 = span(r, "b", 0, "stream"), span(r, "b", 1, "stream")
    assert (b0.start, b0.end) == (4.0, 6.0)  # waits for a on batch 0 (ended 4), not batch 1 (ends 8)
    assert (b1.start, b1.end) == (8.0, 10.0)
    assert span(r, "b", 0, "thread").start == 2.0  # host side ran long before: kernels queue up
    assert r.iteration_s == 4.0  # stream s1 is the bottleneck
    assert r.critical_path[-1].reason == "event wait on a"


def test_missing_event_falls_back_to_waiting_for_the_producer_stream():
    # c waits for x's run on the previous batch; for batch 0 there is none, so (as the engine
    # does) it waits for everything already submitted to x's stream, i.e. x on batch 0.
    p = plan(
        T("x", stream="s1", lookahead=1, writes=["v"]),
        T("c", lookahead=1, cross_iter_depends_on=["x"]),
        T("d", reads=[DataSlot("v", 0)], writes=["step_result"]),
    )
    r = simulate(p, costs(x=(1.0, 5.0), c=(1.0, 1.0), d=(1.0, 0.0)))
    c0 = span(r, "c", 0, "stream")
    assert (c0.start, c0.end) == (5.0, 6.0)
    c1 = span(r, "c", 1, "stream")
    assert c1.start == 6.0  # event of x on batch 0 (ended 5), then its own stream (c0 ended 6)


def test_nccl_tickets_serialise_host_spans_across_threads():
    p = plan(T("a", nccl=True), T("b", stream="s1", nccl=True, writes=["step_result"]))
    c = costs(a=(2.0,), b=(3.0,))
    r = simulate(p, c, thread_map="per_task")
    assert span(r, "b", 0, "thread").start == 2.0
    assert r.iteration_s == 5.0
    assert r.critical_path[-1].reason == "nccl ticket"
    free = simulate(plan(T("a"), T("b", stream="s1", writes=["step_result"])), c, thread_map="per_task")
    assert free.iteration_s == 3.0
    # tickets follow topological order: declared the other way round, b goes first
    r2 = simulate(
        plan(T("b", stream="s1", nccl=True, writes=["step_result"]), T("a", nccl=True)), c, thread_map="per_task"
    )
    assert (span(r2, "a", 0, "thread").start, r2.iteration_s) == (3.0, 5.0)


def test_nccl_communicator_serialises_device_work_across_streams():
    p = plan(T("a", stream="s1", nccl=True), T("b", stream="s2", nccl=True, writes=["step_result"]))
    r = simulate(p, costs(a=(0.5, 4.0), b=(0.5, 4.0)))
    b0 = span(r, "b", 0, "stream")
    assert (b0.start, b0.end) == (4.0, 8.0)
    assert r.iteration_s == 8.0
    assert r.busy_per_iteration["nccl"] == 8.0
    p2 = plan(T("a", stream="s1"), T("b", stream="s2", writes=["step_result"]))
    assert simulate(p2, costs(a=(0.5, 4.0), b=(0.5, 4.0))).iteration_s == 4.0


def test_same_stream_is_fifo_across_threads():
    # b follows a on stream s1 although they are independent and on different threads
    p = plan(T("a", stream="s1"), T("b", stream="s1", writes=["step_result"]))
    r = simulate(p, costs(a=(2.0, 3.0), b=(1.0, 1.0)), thread_map="per_task")
    b0h, b0d = span(r, "b", 0, "thread"), span(r, "b", 0, "stream")
    assert (b0h.start, b0h.end) == (2.0, 3.0)  # same-stream FIFO is a CPU edge too
    assert (b0d.start, b0d.end) == (3.0, 4.0)
    assert r.iteration_s == 4.0


def test_pcie_tasks_share_one_link():
    p = plan(T("a", stream="s1"), T("b", stream="s2", writes=["step_result"]))
    link = costs(a=TaskCost(0.5, 3.0, pcie=True), b=TaskCost(0.5, 3.0, pcie=True))
    r = simulate(p, link)
    assert (span(r, "b", 0, "stream").start, r.iteration_s) == (3.0, 6.0)
    assert r.utilisation["pcie"] == 1.0


def test_host_sync_keeps_the_thread_until_the_device_finishes():
    p = plan(T("a", stream="s1", writes=["x"]), T("b", writes=["step_result"]))
    r = simulate(p, costs(a=TaskCost(1.0, 5.0, host_sync=True), b=(1.0,)))
    assert span(r, "b", 0, "thread").start == 5.0
    assert r.iteration_s == 6.0
    assert simulate(p, costs(a=(1.0, 5.0), b=(1.0,))).iteration_s == 5.0


def test_iteration_time_is_set_by_a_stream_or_by_a_thread():
    two = plan(T("a", stream="s1"), T("b", stream="s2", writes=["step_result"]))
    thread_bound = simulate(two, costs(a=(2.0, 3.0), b=(2.0, 3.0)))
    assert thread_bound.iteration_s == 4.0
    assert max(thread_bound.busy_per_iteration, key=thread_bound.busy_per_iteration.get) == "thread:main"
    one = plan(T("a", stream="s1"), T("b", stream="s1", writes=["step_result"]))
    stream_bound = simulate(one, costs(a=(2.0, 3.0), b=(2.0, 3.0)))
    assert stream_bound.iteration_s == 6.0
    assert stream_bound.utilisation["stream:s1"] == 1.0 and stream_bound.utilisation["thread:main"] == 4.0 / 6.0


def test_a_slow_start_up_transient_is_played_out():
    # The prefill queues device work of the lookahead-2 task faster than the steady state
    # drains it (3.5 per step on the stream, 4 per step on the host): for several steps the
    # completions are 3.5 apart, then settle at the host's 4.
    p = plan(
        T("load", lookahead=2, reads=["batch_cpu"], writes=["x"]),
        T("fwd", lookahead=1, reads=["x"], writes=["y"]),
        T("step", reads=["y"], writes=["step_result"]),
    )
    r = simulate(p, costs(load=(2.0, 3.5), fwd=(1.0,), step=(1.0,)), iterations=8)
    assert r.iteration_s == 4.0 and r.period == 1
    assert r.num_batches == 16  # 8 batches were not enough to see the steady state
    assert r.completions[1] - r.completions[0] == 3.5


def test_prefill_and_drain_run_every_task_on_every_batch_once():
    p = plan(
        T("load", stream="s1", lookahead=2, reads=["batch_cpu"], writes=["x"]),
        T("prep", stream="s2", lookahead=1, reads=["x"], writes=["y"]),
        T("train", reads=["y"], writes=["step_result"]),
    )
    m = 9
    r = simulate(p, costs(load=(1.0, 1.0), prep=(1.0, 1.0), train=(1.0, 1.0)), "by_stream", iterations=m)
    la = {"load": 2, "prep": 1, "train": 0}
    for task in la:
        hosts = sorted((s.batch, s.iteration) for s in r.spans if s.task == task and s.resource.startswith("thread"))
        assert hosts == [(b, b + 2 - la[task]) for b in range(m)]
    assert r.num_batches == m and r.max_lookahead == 2 and r.window == (3, 6)
    # a prefill iteration runs only the deep tasks: iteration 0 is load alone
    assert {s.task for s in r.spans if s.iteration == 0} == {"load"}
    assert {s.task for s in r.spans if s.iteration == m + 1} == {"train"}


def test_costs_from_json_text_and_recorded_threads():
    p = plan(T("a"), T("b", stream="s1", writes=["step_result"]))
    text = (
        '{"tasks": {"a": {"cpu_s": 2, "device_s": 0, "thread": "x"}, "b": {"cpu_s": 3, "device_s": 0, "thread": "y"}}}'
    )
    assert simulate(p, text).iteration_s == 3.0  # threads recorded by the profiler
    assert simulate(p, text, thread_map="sequential").iteration_s == 5.0
    assert simulate(p, text, thread_map=lambda t: "one").iteration_s == 5.0


def test_bad_input_is_named():
    p = plan(T("a", lookahead=3), T("b", writes=["step_result"]))
    with pytest.raises(KeyError, match="no entry for task"):
        simulate(p, costs(a=(1.0,)))
    with pytest.raises(ValueError, match="need at least 6"):
        simulate(p, costs(a=(1.0,), b=(1.0,)), iterations=5)


def test_report_lists_step_utilisation_and_critical_path():
    p = plan(T("a"), T("b", stream="s1"), T("c", writes=["step_result"]))
    text = simulate(p, costs(a=(0.003,), b=(0.005,), c=(0.001,)), thread_map={"b": "B", "default": "A"}).report()
    assert text.splitlines()[0] == "predicted step: 5 ms (12 batches played)"
    assert [line.split() for line in text.splitlines() if "thread:B " in line] == [["thread:B", "100.0%", "(5", "ms)"]]
    assert text.rstrip().endswith("b batch 11 on thread:B: barrier")


def test_plot_writes_a_png(tmp_path):
    p = plan(T("a", stream="s1", lookahead=1, writes=["x"]), T("b", reads=["x"], writes=["step_result"]))
    r = simulate(p, costs(a=(1.0, 2.0), b=(1.0, 2.0)), "by_stream")
    out = r.plot(tmp_path / "gantt.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- invariants over random plans ------------------------------------------------------------------


@st.composite
def random_plans(draw):
    specs = draw(task_graph_specs(max_tasks=6, max_lookahead=3))
    for spec in specs:
        spec["nccl"] = draw(st.booleans())
    task_graph = build(specs, Trace())
    ms = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5])
    model = CostModel(
        {
            s["name"]: TaskCost(
                draw(ms), draw(ms), pcie=draw(st.booleans()), host_sync=draw(st.sampled_from([False, False, True]))
            )
            for s in specs
        }
    )
    names = [s["name"] for s in specs]
    thread_map = draw(
        st.sampled_from(["sequential", "by_stream", "per_task", "dict"]).map(
            lambda kind: {n: f"T{draw(st.integers(0, 2))}" for n in names} if kind == "dict" else kind
        )
    )
    return task_graph, model, thread_map


def _close_ge(a: float, b: float) -> bool:
    return a >= b - 1e-9 * max(1.0, abs(b))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_plans(), st.integers(0, 10))
def test_invariants_on_random_plans(case, extra):
    task_graph, model, thread_map = case
    graph = compile_dependencies(task_graph)
    L = graph.max_lookahead
    r = simulate(task_graph, model, thread_map, iterations=L + 6 + extra)
    m = r.num_batches  # more than asked when the start-up transient took longer
    # without a first-come link the playback is max-plus linear, hence eventually periodic
    assert r.settled or any(c.pcie for c in model.tasks.values())
    tasks = {t.name: t for t in graph.order}

    host, device = {}, {}
    for s in r.spans:
        table = host if s.resource.startswith("thread") else device if s.resource.startswith("stream") else None
        if table is not None:
            key = (s.task, s.batch)
            assert key not in table, f"{key} ran twice on {s.resource}"
            table[key] = s
    for t in graph.order:  # every task on every batch exactly once, in the iteration the mask says
        assert sorted(b for (n, b) in host if n == t.name) == list(range(m))
        for b in range(m):
            it = host[(t.name, b)].iteration
            assert it == b + L - t.lookahead and fires(t.lookahead, L, it, m)

    by_resource = {}
    for s in r.spans:  # no resource runs two spans at once
        by_resource.setdefault(s.resource, []).append(s)
    for spans in by_resource.values():
        spans.sort(key=lambda s: (s.start, s.end))
        for x, y in zip(spans, spans[1:]):
            assert _close_ge(y.start, x.end), (x, y)

    for b in range(m):  # device work starts after its submission
        for name in tasks:
            assert _close_ge(device[(name, b)].start, host[(name, b)].start)

    for d in graph.dependencies:  # every dependency respected, on the producer run the ring holds
        prod, cons = tasks[d.producer], tasks[d.consumer]
        for b in range(m):
            it = b + L - cons.lookahead
            pit = it - d.delta
            pb = pit - L + prod.lookahead
            if pit < 0 or not fires(prod.lookahead, L, pit, m):
                continue
            p_done = max(host[(prod.name, pb)].end, device[(prod.name, pb)].end if model[prod.name].host_sync else 0)
            assert _close_ge(host[(cons.name, b)].start, p_done), (d, b)
            assert _close_ge(device[(cons.name, b)].start, device[(prod.name, pb)].end), (d, b)

    worst = max(r.busy_per_iteration.values())
    assert _close_ge(r.iteration_s, worst), (r.iteration_s, r.busy_per_iteration)
    assert all(math.isfinite(c) for c in r.completions)


@settings(max_examples=60, deadline=None)
@given(task_graph_specs(max_tasks=6, max_lookahead=3), st.data())
def test_one_thread_without_device_time_steps_in_the_sum_of_host_times(specs, data):
    task_graph = build(specs, Trace())
    cpu = {s["name"]: data.draw(st.sampled_from([0.25, 0.5, 1.0, 1.5, 3.0])) for s in specs}
    model = CostModel({n: TaskCost(c, 0.0) for n, c in cpu.items()})
    r = simulate(task_graph, model, "sequential", iterations=task_graph.max_lookahead + 5)
    assert r.iteration_s == pytest.approx(sum(cpu.values()), rel=1e-12)


def test_multi_stage_schedules_barrier_between_stages():
    s = TaskGraph(
        groups=(TaskGroup((T("a"), T("b", stream="s1"))), TaskGroup((T("c", writes=["step_result"]),))),
        stream_slots=("default", "s1"),
    )
    r = simulate(s, costs(a=(2.0,), b=(3.0,), c=(1.0,)), "per_task")
    assert span(r, "c", 0, "thread").start == 3.0  # after group 1's barrier
    assert r.iteration_s == 4.0
