"""Lookahead assignment, the joint tuner and plan YAML output."""

from __future__ import annotations

import pytest
from _task_graphs import Trace, build, task_graph_specs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsys_pipe.autosched import CostModel, TaskCost, auto_assign_lookaheads, plan_yaml, simulate, tune
from recsys_pipe.engine import Task, TaskGraph, TaskGroup, compile_dependencies


def noop(ctx):
    pass


def T(name: str, **fields) -> Task:
    return Task.from_fn(name, noop, **fields)


def chain() -> TaskGraph:
    return TaskGraph.single_group(
        [
            T("h2d", stream="memcpy", reads=["batch_cpu"], writes=["batch_gpu"]),
            T("forward", reads=["batch_gpu"], writes=["loss"]),
            T("optimizer_step", reads=["loss"], writes=["step_result"]),
        ]
    )


CHAIN_COSTS = CostModel({"h2d": TaskCost(3.0), "forward": TaskCost(2.0), "optimizer_step": TaskCost(1.0)})
IO = {"h2d": "io", "default": "compute"}


def with_lookaheads(task_graph: TaskGraph, lookaheads: dict[str, int]) -> TaskGraph:
    return TaskGraph.single_group([t.replace(lookahead=lookaheads[t.name]) for t in task_graph.tasks])


def two_heavy_tasks() -> tuple[TaskGraph, CostModel]:
    s = TaskGraph.single_group(
        [T("a", stream="s1", writes=["x"]), T("b", stream="s2", writes=["y"]), T("forward", reads=["x", "y"])]
    )
    return s, CostModel({"a": TaskCost(4.0), "b": TaskCost(4.0), "forward": TaskCost(1.0)})


def test_an_expensive_copy_on_its_own_thread_goes_one_batch_ahead():
    before = simulate(chain(), CHAIN_COSTS, IO).iteration_s
    assert before == 6.0  # forward waits for this batch's copy: 3 + 2 + 1
    lookaheads = auto_assign_lookaheads(chain(), CHAIN_COSTS, thread_map=IO)
    assert lookaheads == {"h2d": 1, "forward": 0, "optimizer_step": 0}  # 2 deep would not be faster
    assert simulate(with_lookaheads(chain(), lookaheads), CHAIN_COSTS, IO).iteration_s == 3.0


def test_lookaheads_stay_when_going_ahead_does_not_help():
    # one thread: the copy costs the same host time whichever batch it works on
    assert auto_assign_lookaheads(chain(), CHAIN_COSTS) == {"h2d": 0, "forward": 0, "optimizer_step": 0}
    # one batch in flight allowed: nothing may go ahead
    assert auto_assign_lookaheads(chain(), CHAIN_COSTS, max_in_flight=1, thread_map=IO)["h2d"] == 0


def test_a_whole_lookahead_level_moves_together():
    # a and b feed forward; going ahead pays only if both do (each alone still blocks forward)
    s, costs = two_heavy_tasks()
    assert auto_assign_lookaheads(s, costs, thread_map="per_task") == {"a": 1, "b": 1, "forward": 0}


def test_frozen_tasks_must_start_at_lookahead_zero():
    s = with_lookaheads(chain(), {"h2d": 1, "forward": 1, "optimizer_step": 0})
    with pytest.raises(ValueError, match="frozen task 'forward' must stay at lookahead 0"):
        auto_assign_lookaheads(s, CHAIN_COSTS)


def test_tune_splits_independent_host_work_across_threads():
    s, costs = two_heavy_tasks()
    result = tune(s, costs)  # everything on one thread: 4 + 4 + 1
    assert result.original_s == 9.0
    # a, b and forward on three threads, a and b one batch ahead: the step waits for neither
    assert result.best_s == 4.0
    threads = result.thread_map
    assert len({threads["a"], threads["b"], threads["forward"]}) == 3
    assert {t.name: t.lookahead for t in result.task_graph.tasks} == {"a": 1, "b": 1, "forward": 0}
    assert simulate(result.task_graph, costs, threads).iteration_s == 4.0
    changed = {c.task for c in result.changes if c.changed}
    assert changed == {"a", "b", "forward"}
    assert "predicted step: 9000 ms -> 4000 ms (2.250x)" in result.diff()

    two = tune(s, costs, max_threads=2)  # with two threads the best is 4 + 1 on one of them
    assert two.best_s == 5.0 and len(set(two.thread_map.values())) == 2


def test_tune_may_use_extra_streams():
    # the serial layout: one stream, so same-stream order chains the copy to the step
    s = TaskGraph.single_group([t.replace(stream="default") for t in chain().tasks])
    assert tune(s, CHAIN_COSTS, IO).best_s == 6.0
    result = tune(s, CHAIN_COSTS, IO, streams=["memcpy"])
    assert result.best_s == 3.0
    assert next(t for t in result.task_graph.tasks if t.name == "h2d").stream == "memcpy"
    assert "memcpy" in result.task_graph.stream_slots


def test_tune_is_deterministic_for_a_seed():
    s, costs = two_heavy_tasks()
    first = tune(s, costs, seed=3, max_children=4)
    second = tune(s, costs, seed=3, max_children=4)
    assert first.changes == second.changes and first.best_s == second.best_s


def test_tune_refuses_an_input_that_breaks_the_rules():
    s, costs = two_heavy_tasks()
    with pytest.raises(ValueError, match="3 threads > max_threads=2"):
        tune(s, costs, "per_task", max_threads=2)


# -- random plans ---------------------------------------------------------------------------------


@st.composite
def tuning_cases(draw):
    specs = draw(task_graph_specs(max_tasks=5, max_lookahead=2))
    for spec in specs:
        spec["nccl"] = draw(st.booleans())
    task_graph = build(specs, Trace())
    names = [s["name"] for s in specs]
    ms = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0])
    costs = CostModel({n: TaskCost(draw(ms), draw(ms), pcie=draw(st.booleans())) for n in names})
    max_threads = draw(st.integers(1, 4))
    threads = {n: f"T{draw(st.integers(0, max_threads - 1))}" for n in names}
    frozen = {s["name"] for s in specs if s["lookahead"] == 0 and s["stream"] == "default" and draw(st.booleans())}
    max_in_flight = max(s["lookahead"] for s in specs) + 1 + draw(st.integers(0, 2))
    return task_graph, costs, threads, frozen, max_threads, max_in_flight


def _dependencies(task_graph: TaskGraph) -> set:
    return {(d.producer, d.consumer, d.kind, d.field) for d in compile_dependencies(task_graph).dependencies}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tuning_cases(), st.integers(0, 3))
def test_tune_returns_a_legal_plan_that_is_never_predicted_slower(case, seed):
    task_graph, costs, threads, frozen, max_threads, max_in_flight = case
    result = tune(
        task_graph,
        costs,
        threads,
        frozen=frozen,
        max_threads=max_threads,
        max_in_flight=max_in_flight,
        max_evaluations=120,
        rounds=2,
        seed=seed,
        iterations=8,
    )
    tuned = result.task_graph
    graph = compile_dependencies(tuned)  # the engine's validator accepts it
    assert result.best_s <= result.original_s * (1 + 1e-9)
    assert result.original_s == simulate(task_graph, costs, threads, 8).iteration_s
    assert result.best_s == simulate(tuned, costs, result.thread_map, 8).iteration_s
    assert len(set(result.thread_map.values())) <= max_threads
    assert tuned.max_lookahead + 1 <= max_in_flight
    tasks = {t.name: t for t in tuned.tasks}
    for name in frozen:
        assert tasks[name].lookahead == 0 and tasks[name].stream == "default"
    original = compile_dependencies(task_graph)
    assert [t.name for t in graph.order if t.nccl] == [t.name for t in original.order if t.nccl]
    assert _dependencies(tuned) == _dependencies(task_graph)  # every declared dependency kept
    assert {t.name for t in tuned.tasks} == {t.name for t in task_graph.tasks}


# -- plan YAML ------------------------------------------------------------------------------------


def test_plan_yaml_loads_back_as_the_same_plan(tmp_path):
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with omegaconf")
    from recsys_pipe.config import compile_plan
    from recsys_pipe.config.resolve import structure_only

    s, costs = two_heavy_tasks()
    result = tune(s, costs)
    fns = {n: f"my_pkg.tasks:{n}" for n in ("a", "b", "forward")}
    path = tmp_path / "pipeline" / "tuned_two.yaml"
    text = plan_yaml(result.task_graph, fns, thread_map=result.thread_map, name="tuned_two", path=path)
    assert path.read_text() == text
    cfg = yaml.safe_load(text)
    assert cfg["executor"] == "threaded" and cfg["thread_map"]["strategy"] == "dict"
    compiled = compile_plan(cfg, resolve_fn=structure_only)
    assert dict(compiled.thread_of) == result.thread_map
    ours = {t.name: t for t in result.task_graph.tasks}
    for t in compiled.task_graph.tasks:
        mine = ours[t.name]
        assert (t.stream, t.lookahead, t.reads, t.writes, t.depends_on) == (
            mine.stream,
            mine.lookahead,
            mine.reads,
            mine.writes,
            mine.depends_on,
        )
    assert simulate(compiled.task_graph, costs, dict(compiled.thread_of)).iteration_s == result.best_s


def test_plan_yaml_keeps_task_options():
    """A tuned semi_sync plan written back keeps its lookups' options (which batches each looks
    up): without them both lookups would do every batch."""
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with omegaconf")
    from recsys_pipe.config import compile_plan
    from recsys_pipe.testing import load_run

    plan = load_run("pipeline=semi_sync", "pipeline.tasks.start_embedding_lookup.options.start_batch=7").pipeline
    compiled = compile_plan(plan)
    text = plan_yaml(compiled.task_graph, compiled.fn_paths(), settings={"torchrec_context": "semi_sync"})
    again = compile_plan(yaml.safe_load(text))
    before = {t.name: t.options for t in compiled.order}
    assert {t.name: t.options for t in again.order} == before
    assert before["start_embedding_lookup_synced"].start_batch == 7


def test_plan_yaml_writes_every_dependency_form():
    from recsys_pipe.engine import DataSlot

    s = TaskGraph.single_group(
        [
            T("load", stream="memcpy", lookahead=2, reads=["batch_cpu"], writes=["x"], nccl=True),
            T("prep", lookahead=1, reads=[DataSlot("x", 2)], cross_iter_depends_on=[("load", -2)], nvtx_tag="my prep"),
            T("step", depends_on=["prep"], same_progress_sync=["load"], nvtx_tag="s", writes=["step_result"]),
        ]
    )
    text = plan_yaml(s, {"load": "m:load", "prep": "m:prep", "step": "m:step"}, description="a: test")
    assert "executor: sequential" in text and 'description: "a: test"' in text
    assert "    reads: [batch_cpu]\n    writes: [x]\n    nccl: true" in text
    assert "    reads: [[x, 2]]\n    cross_iter_depends_on: [[load, -2]]\n" in text
    assert '    nvtx_tag: "my prep"' in text
    assert "    depends_on: [prep]\n    same_progress_sync: [load]\n    nvtx_tag: s" in text
    assert 'fn: "test_autosched_tune:noop"' in plan_yaml(TaskGraph.single_group([T("x")]))  # from the function
    with pytest.raises(ValueError, match="no import path"):
        plan_yaml(TaskGraph.single_group([Task.from_fn("x", lambda ctx: None)]))
    with pytest.raises(ValueError, match="holds one group"):
        plan_yaml(TaskGraph((TaskGroup((T("a"),)), TaskGroup((T("b"),))), ("default",)), {"a": "m:a", "b": "m:b"})
