"""The plan compiler: shipped plans compile, overrides change the compiled task graph as expected,
compiled plans run on the engine, and the loader's helpers map errors to config paths."""

from __future__ import annotations

import itertools

import pytest

from recsys_pipe.cli.plan import PlanCommandConfig
from recsys_pipe.config import (
    CONF_DIR,
    CompiledPlan,
    ConfigError,
    PlanConfig,
    compile_plan,
    firing_table,
    format_path,
    import_fn,
    render_plan,
    structure_only,
)
from recsys_pipe.config.resolve import FnResolveError
from recsys_pipe.engine import BATCH_CPU, StreamPool
from recsys_pipe.testing import compose
from recsys_pipe.train import RunConfig, build_plan_runner, load_run_config, training_plan

PIPELINES = sorted(p.stem for p in (CONF_DIR / "pipeline").glob("*.yaml"))
THREAD_MAPS = sorted(p.stem for p in (CONF_DIR / "thread_map").glob("*.yaml"))


def compiled(*overrides: str, resolve_fn=structure_only) -> CompiledPlan:
    run = load_run_config(compose(*overrides, config_name="plan"), PlanCommandConfig)
    return training_plan(run, resolve_fn=resolve_fn)


def test_required_options_are_shipped():
    assert {"serial", "sparse_dist", "hstu_sparse_dist", "hstu_prefetch"} <= set(PIPELINES)
    assert {"by_stream", "per_task", "single", "hstu_default"} <= set(THREAD_MAPS)
    for group in ("model", "data", "optimizer", "trainer"):
        assert list((CONF_DIR / group).glob("*.yaml")), group


@pytest.mark.parametrize("pipeline,thread_map", list(itertools.product(PIPELINES, THREAD_MAPS)))
def test_every_shipped_plan_compiles(pipeline, thread_map):
    plan = compiled(f"pipeline={pipeline}", f"thread_map={thread_map}")
    assert plan.config.name == pipeline
    assert len(plan.order) == len(plan.config.tasks)
    text = render_plan(plan)
    assert "tasks, in topological order" in text and "progress() returns" in text


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_shipped_plans_resolve_their_task_functions(pipeline):
    plan = compiled(f"pipeline={pipeline}", resolve_fn=import_fn)
    assert all(callable(t.fn) for t in plan.order)


def test_recsys_train_config_validates_too():
    run = load_run_config(compose(config_name="train"))
    assert isinstance(run, RunConfig) and not isinstance(run, PlanCommandConfig)
    plan = training_plan(run, resolve_fn=structure_only)
    assert plan.threaded and plan.config.name == "hstu_prefetch"  # the default plan, scripts/train.sh's


def test_serial_and_lookahead_plans_list_the_same_task_functions():
    fns = {p: set(compiled(f"pipeline={p}").fn_paths().values()) for p in PIPELINES}
    assert fns["serial"] == fns["sparse_dist"] == fns["hstu_sparse_dist"]
    assert fns["hstu_prefetch"] - fns["serial"] == {"recsys_pipe.train.tasks:prefetch_embeddings"}
    assert fns["serial"] <= fns["hstu_prefetch"]
    shuffles = {"recsys_pipe.train.tasks:start_shuffle", "recsys_pipe.train.tasks:finish_shuffle"}
    assert fns["serial_balanced"] == fns["hstu_sparse_dist_balanced"] == fns["serial"] | shuffles
    assert fns["hstu_prefetch_balanced"] == fns["hstu_prefetch"] | shuffles


def test_balanced_plans_shuffle_at_h2d_lookahead_on_its_stream():
    for name in ("hstu_sparse_dist_balanced", "hstu_prefetch_balanced"):
        plan = compiled(f"pipeline={name}")
        tasks = {t.name: t for t in plan.order}
        for shuffle in ("start_shuffle", "finish_shuffle"):
            assert (tasks[shuffle].lookahead, tasks[shuffle].stream, tasks[shuffle].nccl) == (2, "memcpy", True)
            assert plan.thread_of[shuffle] == plan.thread_of["h2d"] == "io"
        order = [t.name for t in plan.order]
        # the partition is solved between the two halves, while the step's collectives run
        assert order.index("start_shuffle") < order.index("start_input_dist")
        assert order.index("finalize_model_grads") < order.index("finish_shuffle")


def test_serial_plan_is_one_batch_sequential_default_stream():
    plan = compiled("pipeline=serial")
    assert not plan.threaded
    assert plan.graph.in_flight_batches == 1
    assert {t.stream for t in plan.order} == {"default"}
    assert not any(plan.graph.event_waits.values())
    assert [t.name for t in plan.order][:3] == ["h2d", "start_input_dist", "wait_input_dist"]


def test_hstu_plans_match_spec_table():
    native = compiled("pipeline=hstu_sparse_dist")
    la = {t.name: (t.lookahead, t.stream) for t in native.order}
    assert la["h2d"] == (2, "memcpy")
    assert la["start_input_dist"] == la["wait_input_dist"] == (1, "data_dist")
    assert la["forward"] == la["optimizer_step"] == (0, "default")
    # forward too: its embedding lookup issues the output all-to-all
    assert {t.name for t in native.order if t.nccl} == {
        "start_input_dist",
        "wait_input_dist",
        "forward",
        "backward",
        "finalize_model_grads",
    }
    assert native.graph.in_flight_batches == 3

    pf = compiled("pipeline=hstu_prefetch", "trainer.device=cuda")  # as declared (a CPU run moves two tasks)
    t = pf.graph.task("prefetch_embeddings")
    assert (t.lookahead, t.stream) == (1, "prefetch")
    assert pf.graph.task("backward").same_progress_sync == ("prefetch_embeddings",)
    order = [t.name for t in pf.order]
    assert order.index("forward") < order.index("prefetch_embeddings") < order.index("backward")
    assert any(e.producer == "prefetch_embeddings" and e.consumer == "backward" for e in pf.graph.edges)
    assert any(e.producer == "forward" and e.consumer == "prefetch_embeddings" for e in pf.graph.edges)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_global_token_normalisation_derives_the_all_reduce_task(pipeline):
    local = compiled(f"pipeline={pipeline}")
    assert "global_tokens_allreduce" not in local.thread_of  # no collective torchrec's loop lacks
    derived = compiled(f"pipeline={pipeline}", "model.loss_normalization=global_tokens")
    names = [t.name for t in derived.order]
    task = derived.graph.task("global_tokens_allreduce")
    assert task.nccl and (task.lookahead, task.stream) == (0, "default")
    assert ("global_tokens", 0) in [(s.name, s.batch_offset) for s in derived.graph.task("forward").reads]
    assert names.index("global_tokens_allreduce") < names.index("forward")
    # otherwise the same plan: the same tasks in the same order
    assert [n for n in names if n != "global_tokens_allreduce"] == [t.name for t in local.order]


def test_a_global_tokens_task_needs_the_global_setting():
    from recsys_pipe.config import TaskConfig
    from recsys_pipe.train.plan import derive_plan

    tokens = TaskConfig(
        fn="recsys_pipe.train.tasks:global_tokens_allreduce", reads=["batch_gpu"], writes=["global_tokens"]
    )
    for setting, ok in (("local", False), ("global_tokens", True)):
        run = load_run_config(compose(f"model.loss_normalization={setting}"))
        plan = run.pipeline.model_copy(update={"tasks": {**run.pipeline.tasks, "tokens": tokens}})
        if ok:  # the plan's own all-reduce task is used as it is
            assert list(derive_plan(plan, run).tasks) == list(plan.tasks)
        else:
            with pytest.raises(ConfigError, match="model.loss_normalization=local") as info:
                derive_plan(plan, run)
            assert info.value.paths == ["pipeline.tasks.tokens"]


def test_default_thread_map_is_io_compute():
    plan = compiled()
    assert plan.thread_of["h2d"] == "io"
    assert {plan.thread_of[n] for n in plan.thread_of if n != "h2d"} == {"compute"}


@pytest.mark.parametrize(
    "choice,expected",
    [
        ("per_task", lambda t: t.name),
        ("by_stream", lambda t: t.stream),
        ("single", lambda t: "main"),
        ("hstu_default", lambda t: "io" if t.name == "h2d" else "compute"),
    ],
)
def test_thread_map_override_changes_threads(choice, expected):
    plan = compiled("pipeline=hstu_prefetch", f"thread_map={choice}")
    assert plan.threaded
    assert plan.thread_of == {t.name: expected(t) for t in plan.order}


def test_cross_thread_edges_follow_the_thread_map():
    single = compiled("thread_map=single")
    assert not any(e.cross_thread for e in single.cpu_edges())
    per_task = compiled("thread_map=per_task")
    assert all(e.cross_thread for e in per_task.cpu_edges())
    kinds = {e.kind for e in per_task.cpu_edges()}
    assert {"slot", "depends_on"} <= kinds
    # the derived all-reduce has no declared edge to zero_grad: stream FIFO orders them
    derived = compiled("thread_map=per_task", "model.loss_normalization=global_tokens")
    fifo = [(e.producer, e.consumer) for e in derived.cpu_edges() if e.kind == "stream_fifo"]
    assert fifo == [("zero_grad", "global_tokens_allreduce")]


def test_per_task_thread_overrides_the_map():
    plan = compiled("pipeline.tasks.forward.thread=fwd", "thread_map=hstu_default")
    assert plan.thread_of["forward"] == "fwd"
    assert plan.thread_of["backward"] == "compute"


def test_lookahead_override_changes_the_task_graph():
    base = compiled("pipeline=hstu_prefetch")
    deeper = compiled("pipeline=hstu_prefetch", "pipeline.tasks.h2d.lookahead=3")
    assert base.graph.max_lookahead == 2 and deeper.graph.max_lookahead == 3
    assert deeper.graph.in_flight_batches == 4
    assert deeper.graph.task("h2d").lookahead == 3
    # start_input_dist still reads h2d's output for its own batch: the wait stays at its la (1).
    waits = {w.producer: w.slot_offset for w in deeper.graph.event_waits["start_input_dist"]}
    assert waits == {"h2d": 1}
    delta = {(d.producer, d.consumer): d.delta for d in deeper.graph.dependencies}
    assert delta[("h2d", "start_input_dist")] == 2
    table = firing_table(deeper, 4)
    assert table.phases[:3] == ("prefill",) * 3 and table.num_iterations == 7
    assert table.rows[0].tasks == ("h2d",) and table.rows[0].cells[:4] == (0, 1, 2, 3)


def test_lookahead_override_on_defaulted_field():
    # zero_grad's YAML does not spell out `lookahead`: the skeleton makes it overridable anyway.
    plan = compiled(
        "pipeline.tasks.zero_grad.lookahead=1",
        "pipeline.tasks.forward.depends_on=[]",
        "pipeline.tasks.zero_grad.stream=memcpy",
    )
    assert plan.graph.task("zero_grad").lookahead == 1


def test_add_and_remove_overrides():
    plan = compiled(
        "~pipeline.tasks.zero_grad", "pipeline.tasks.forward.depends_on=[]", "+pipeline.tasks.forward.nvtx_tag=fwd_nvtx"
    )
    assert "zero_grad" not in plan.thread_of
    assert plan.graph.task("forward").nvtx_tag == "fwd_nvtx"


def test_executor_override():
    plan = compiled("pipeline=hstu_sparse_dist", "pipeline.executor=sequential")
    assert not plan.threaded
    assert set(plan.thread_of.values()) == {"main"}


def test_sparse_dist_is_torchrec_layout_on_one_thread():
    plan = compiled("pipeline=sparse_dist")
    assert not plan.threaded
    assert plan.graph.task("h2d").lookahead == 2 and plan.graph.task("start_input_dist").lookahead == 1


# -- compiled plans run ---------------------------------------------------------------------------


def _stub(path: str):
    """A task body that writes, for every declared slot, the raw batch it processes."""

    def body(ctx):
        batch = ctx.slots[BATCH_CPU]
        for slot in ctx.task.reads:
            if slot.name != BATCH_CPU:
                assert ctx.ring.at(slot.batch_offset)[slot.name] == batch, (ctx.task.name, slot)
        for slot in ctx.task.writes:
            ctx.ring.at(slot.batch_offset).set(slot.name, batch)

    return body


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("overrides", [(), ("thread_map=per_task", "pipeline.tasks.h2d.lookahead=3")])
def test_compiled_plans_run_every_batch_once_in_order(pipeline, overrides):
    plan = compiled(f"pipeline={pipeline}", *overrides, resolve_fn=_stub)
    pool = StreamPool.create(plan.task_graph.stream_slots)
    with build_plan_runner(plan, pool, state=None) as runner:
        results = list(runner.iterate(range(7)))
    assert results == list(range(7))


# -- pieces ---------------------------------------------------------------------------------------


def test_format_path():
    assert format_path(("pipeline", "tasks", "h2d", "reads", 0)) == "pipeline.tasks.h2d.reads[0]"
    assert format_path(()) == ""


def test_compile_from_plain_dict_reports_paths():
    plan = {
        "executor": "threaded",
        "streams": ["default", "side"],
        "tasks": {
            "a": {"fn": "x:y", "stream": "side", "writes": ["v"]},
            "b": {"fn": "x:y", "reads": ["v"], "depends_on": ["c"], "lookahed": 1},
        },
    }
    with pytest.raises(ConfigError) as info:
        compile_plan(plan, resolve_fn=structure_only)
    assert info.value.paths == ["pipeline.tasks.b.lookahed"]
    del plan["tasks"]["b"]["lookahed"]
    with pytest.raises(ConfigError) as info:
        compile_plan(plan, resolve_fn=structure_only)
    assert info.value.paths == ["pipeline.tasks.b.depends_on[0]"]
    assert "unknown task 'c'" in str(info.value)
    plan["tasks"]["b"]["depends_on"] = []
    compiled_plan = compile_plan(plan, resolve_fn=structure_only)
    assert [w.producer for w in compiled_plan.graph.event_waits["b"]] == ["a"]


def test_all_problems_reported_at_once():
    plan = PlanConfig.model_validate(
        {
            "tasks": {
                "a": {"fn": "no_such_module_xyz:f", "stream": "nope"},
                "b": {"fn": "os.path:join", "depends_on": ["zz"], "reads": ["missing"]},
            }
        }
    )
    with pytest.raises(ConfigError) as info:
        compile_plan(plan)
    assert set(info.value.paths) == {
        "pipeline.tasks.a.fn",
        "pipeline.tasks.a.stream",
        "pipeline.tasks.b.depends_on[0]",
        "pipeline.tasks.b.reads[0]",
    }


@pytest.mark.parametrize(
    "path,fragment",
    [
        ("recsys_pipe.train.tasks:nope", "has no attribute"),
        ("no_such_pkg_xyz.mod:f", "No module named"),
        ("forward", "not an import path"),
        ("recsys_pipe:config", "not a function"),
        ("recsys_pipe.config.schema:TASK_FIELDS", "not a function"),
        # the dotted spelling of earlier plans: refused, with the colon form to write
        ("recsys_pipe.train.tasks.forward", r"write pkg.module:function \('recsys_pipe.train.tasks:forward'\)"),
    ],
)
def test_import_fn_errors(path, fragment):
    with pytest.raises(FnResolveError, match=fragment):
        import_fn(path)


def test_import_fn_forms():
    import os.path

    assert import_fn("os.path:join") is os.path.join
    assert import_fn("recsys_pipe.config:PlanConfig.model_validate") == PlanConfig.model_validate
