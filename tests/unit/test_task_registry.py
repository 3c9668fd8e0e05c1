"""The task registry: tasks by name (`fn: h2d`) with what they need from the run; the plan builder
asks the tasks (balancer built, prefetch context required, idle tasks, the forward task found)
instead of comparing import paths; a user's own function, registered or not, works by import path."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import types
import typing
from pathlib import Path

import pytest
import torch

import recsys_pipe
from recsys_pipe.config import (
    TASKS,
    ConfigError,
    Need,
    TaskConfig,
    TaskRegistry,
    UnknownTaskError,
    compile_plan,
    structure_only,
    task,
)
from recsys_pipe.engine import STEP_RESULT, StreamPool, TaskContext
from recsys_pipe.runtime import DistInfo
from recsys_pipe.testing import load_run
from recsys_pipe.train import build_plan_runner, build_state, training_plan
from recsys_pipe.train import tasks as builtin
from recsys_pipe.train.plan import derive_plan, idle_tasks
from recsys_pipe.train.state import TrainState

SHIPPED = {
    "h2d": set(),
    "start_shuffle": {Need.BALANCER},
    "finish_shuffle": {Need.BALANCER},
    "start_input_dist": {Need.SPARSE_DIST},
    "wait_input_dist": {Need.SPARSE_DIST},
    "prefetch_embeddings": {Need.SPARSE_DIST, Need.PREFETCH_CONTEXT},
    "zero_grad": set(),
    "global_tokens_allreduce": set(),
    "forward": set(),
    "backward": set(),
    "finalize_model_grads": {Need.GRAD_BUFFERS},
    "optimizer_step": set(),
}


def noop(ctx) -> None:
    pass


def other(ctx) -> None:
    pass


# -- the registry -----------------------------------------------------------------------------------


def test_register_and_look_up_by_name_and_by_function():
    reg = TaskRegistry()

    @task("my_task", needs={Need.BALANCER}, registry=reg)
    def my_task(ctx) -> None:
        pass

    spec = reg.lookup("my_task")
    assert spec.fn is my_task and spec.needs == {Need.BALANCER} and spec.name == "my_task"
    assert reg.spec_of(my_task) is spec and reg.spec_of(noop) is None
    assert spec.path == f"{__name__}:test_register_and_look_up_by_name_and_by_function.<locals>.my_task"
    assert reg.names == ("my_task",) and "my_task" in reg
    reg.register("my_task", my_task, {Need.BALANCER})  # the same function again: nothing changes
    assert reg.lookup("my_task") is not None


def test_duplicate_and_malformed_registrations_are_refused():
    reg = TaskRegistry()
    reg.register("a", noop)
    with pytest.raises(ValueError, match="task name 'a' is already registered for test_task_registry.noop"):
        reg.register("a", other)
    with pytest.raises(ValueError, match="already registered as task 'a'"):
        reg.register("b", noop)
    for bad in ("my.task", "pkg:fn", "", "1st"):
        with pytest.raises(ValueError, match="identifier"):
            reg.register(bad, other)
    with pytest.raises(TypeError, match="Need members"):
        reg.register("c", other, needs={"balancer"})
    with pytest.raises(TypeError, match="not a function"):
        reg.register("d", 3)
    assert reg.names == ("a",)


def test_unknown_name_suggests_the_closest():
    with pytest.raises(UnknownTaskError, match=r"unknown task 'forwrd' \(did you mean 'forward'\?\); registered"):
        TASKS.lookup("forwrd")


def test_the_shipped_tasks_are_registered_with_their_needs():
    for name, needs in SHIPPED.items():
        spec = TASKS.lookup(name)
        assert spec.fn is getattr(builtin, name) and spec.needs == needs, name
        assert spec.path == f"recsys_pipe.train.tasks:{name}"
    assert set(SHIPPED) <= set(TASKS.names)


def test_the_shipped_tasks_see_a_typed_state():
    for name in SHIPPED:
        hint = typing.get_type_hints(getattr(builtin, name))["ctx"]
        assert typing.get_origin(hint) is TaskContext and typing.get_args(hint) == (TrainState,), name


def test_the_training_package_names_its_task_modules_and_a_lookup_imports_them():
    """`recsys_pipe.config` names no task module (it sits below the training package); importing
    `recsys_pipe.train` names the shipped ones, and the first lookup imports them."""
    code = (
        "import sys\nfrom recsys_pipe.config import TASKS, UnknownTaskError\n"
        "try:\n    TASKS.lookup('h2d')\nexcept UnknownTaskError:\n    pass\n"
        "else:\n    raise AssertionError('the config package found a shipped task by itself')\n"
        "import recsys_pipe.train\n"
        "assert 'recsys_pipe.train.tasks' not in sys.modules\n"
        "spec = TASKS.lookup('h2d')\n"
        "assert 'recsys_pipe.train.tasks' in sys.modules and spec.fn is sys.modules['recsys_pipe.train.tasks'].h2d\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def _module(tmp_path: Path, monkeypatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_entry_points_name_task_modules(tmp_path, monkeypatch):
    """An installed package advertises its task modules under the `recsys_pipe.tasks` group."""
    reg = TaskRegistry(entry_point_group="recsys_pipe.tasks")
    holder = types.ModuleType("reg_under_test")
    holder.REG = reg
    monkeypatch.setitem(sys.modules, "reg_under_test", holder)
    _module(
        tmp_path,
        monkeypatch,
        "ep_tasks_mod",
        """
        from recsys_pipe.config import task
        from reg_under_test import REG

        @task("plugin_task", registry=REG)
        def plugin_task(ctx):
            pass
        """,
    )
    seen = []

    def fake_entry_points(group):
        seen.append(group)
        return [types.SimpleNamespace(name="mine", value="ep_tasks_mod")]

    monkeypatch.setattr("recsys_pipe.config.task_registry.entry_points", fake_entry_points)
    assert reg.lookup("plugin_task").fn is sys.modules["ep_tasks_mod"].plugin_task
    assert seen == ["recsys_pipe.tasks"]


# -- plans --------------------------------------------------------------------------------------------


def test_a_misspelt_name_is_a_config_error_at_its_path():
    plan = {"tasks": {"a": {"fn": "h2e", "reads": ["batch_cpu"]}}}
    for resolve_fn in (None, structure_only):
        with pytest.raises(ConfigError) as info:
            compile_plan(plan, resolve_fn=resolve_fn)
        assert info.value.paths == ["pipeline.tasks.a.fn"]
        assert "unknown task 'h2e' (did you mean 'h2d'?)" in str(info.value)


def test_names_and_import_paths_reach_the_same_entry():
    plan = {
        "tasks": {
            "by_name": {"fn": "forward"},
            "by_colon_path": {"fn": "recsys_pipe.train.tasks:forward"},
        }
    }
    compiled = compile_plan(plan)
    assert {name: spec.fn for name, spec in compiled.specs.items()} == dict.fromkeys(plan["tasks"], builtin.forward)
    assert set(compiled.fn_paths().values()) == {"recsys_pipe.train.tasks:forward"}
    # structure-only: names are still known, import paths are not imported
    shallow = compile_plan(plan, resolve_fn=structure_only)
    assert set(shallow.specs) == {"by_name"}
    assert shallow.fn_paths()["by_colon_path"] == "recsys_pipe.train.tasks:forward"


@pytest.mark.parametrize("resolve_fn", [None, structure_only])
def test_a_dotted_task_path_is_refused_with_the_colon_form(resolve_fn):
    """One spelling of a user's function: `pkg.module:function` (beside registered names)."""
    with pytest.raises(ConfigError) as info:
        compile_plan({"tasks": {"a": {"fn": "recsys_pipe.train.tasks.forward"}}}, resolve_fn=resolve_fn)
    assert info.value.paths == ["pipeline.tasks.a.fn"]
    assert "write pkg.module:function ('recsys_pipe.train.tasks:forward')" in str(info.value)


def test_recsys_plan_refuses_a_dotted_task_path_in_one_line(tmp_path, capsys):
    from recsys_pipe.cli.plan import run

    code = run([f"hydra.run.dir={tmp_path}", "pipeline.tasks.h2d.fn=recsys_pipe.train.tasks.h2d"])
    err = capsys.readouterr().err
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: pipeline.tasks.h2d.fn: 'recsys_pipe.train.tasks.h2d' is not an import path: "
        "write pkg.module:function ('recsys_pipe.train.tasks:h2d'), or a registered task's name"
    ]
    assert "Traceback" not in err


def test_a_registered_function_need_not_be_importable_by_path():
    """A nested definition has no import path; its name reaches the function itself."""

    @task("nested_task_xyz")
    def nested(ctx) -> None:
        ctx.slots.set(STEP_RESULT, -ctx.slots["batch_cpu"])

    plan = compile_plan({"tasks": {"t": {"fn": "nested_task_xyz", "reads": ["batch_cpu"], "writes": [STEP_RESULT]}}})
    assert plan.graph.task("t").fn is nested
    with build_plan_runner(plan, StreamPool.create(plan.task_graph.stream_slots), state=None) as runner:
        assert list(runner.iterate(range(3))) == [0, -1, -2]


def _user_tasks(tmp_path, monkeypatch) -> None:
    _module(
        tmp_path,
        monkeypatch,
        "user_tasks_mod",
        """
        from recsys_pipe.config import Need, task
        from recsys_pipe.engine import BATCH_CPU, STEP_RESULT

        def plain(ctx):  # no decorator: works by import path, as before the registry
            ctx.slots.set(STEP_RESULT, ctx.slots[BATCH_CPU] * 10)

        @task("user_prefetch_xyz", needs={Need.SPARSE_DIST, Need.PREFETCH_CONTEXT})
        def prefetch(ctx):
            pass

        @task("user_balance_xyz", needs={Need.BALANCER})
        def balance(ctx):
            pass
        """,
    )


def test_a_users_plain_function_runs_by_import_path(tmp_path, monkeypatch):
    _user_tasks(tmp_path, monkeypatch)
    path = "user_tasks_mod:plain"
    plan = compile_plan({"tasks": {"step": {"fn": path, "reads": ["batch_cpu"], "writes": [STEP_RESULT]}}})
    assert plan.specs == {} and plan.fn_paths() == {"step": path}
    with build_plan_runner(plan, StreamPool.create(plan.task_graph.stream_slots), state=None) as runner:
        assert list(runner.iterate(range(4))) == [0, 10, 20, 30]


def _with_task(run, name: str, fn: str, **fields):
    """`run` whose plan has one more task."""
    plan = run.pipeline.model_copy(update={"tasks": {**run.pipeline.tasks, name: TaskConfig(fn=fn, **fields)}})
    return run.model_copy(update={"pipeline": plan})


def test_a_users_registered_task_has_its_needs_honoured(tmp_path, monkeypatch):
    _user_tasks(tmp_path, monkeypatch)
    import user_tasks_mod

    assert TASKS.lookup("user_prefetch_xyz").fn is user_tasks_mod.prefetch
    run = load_run("pipeline=serial", "model=dlrm_torch")
    for fn in ("user_prefetch_xyz", "user_tasks_mod:prefetch"):  # by name or by path: the same entry
        with pytest.raises(ConfigError, match="task.s. mine prefetch embeddings") as info:
            training_plan(_with_task(run, "mine", fn))
        assert info.value.paths == ["pipeline.torchrec_context"]
    prefetching = load_run("pipeline=serial", "model=dlrm_torch", "pipeline.torchrec_context=prefetch")
    prefetching = _with_task(prefetching, "mine", "user_prefetch_xyz")
    assert "mine" in idle_tasks(training_plan(prefetching), prefetching)  # plain torch tables: no sparse dist


INFO = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


@pytest.mark.parametrize(
    "overrides,extra,balancer",
    [
        (["pipeline=serial"], None, False),
        (["pipeline=serial_balanced"], None, True),
        (["pipeline=hstu_prefetch_balanced"], None, True),
        # only the second half of the shuffle: it needs the balancer too
        (["pipeline=serial_balanced", "~pipeline.tasks.start_shuffle"], None, True),
        # a user's task needing it, under a name of its own
        (["pipeline=serial"], "user_balance_xyz", True),
    ],
)
def test_build_state_builds_the_balancer_when_a_task_needs_it(tmp_path, monkeypatch, overrides, extra, balancer):
    _user_tasks(tmp_path, monkeypatch)
    import user_tasks_mod  # noqa: F401  (registers user_balance_xyz)

    if "~pipeline.tasks.start_shuffle" in overrides:
        overrides = [*overrides, "pipeline.tasks.finish_shuffle.reads=[unbalanced_batch]"]
    run = load_run("model=dlrm_torch", *overrides)
    if extra is not None:
        run = _with_task(run, "mine", extra)
    state = build_state(run, training_plan(run), torch.nn.Linear(1, 1), None, INFO)
    try:
        assert (state.balancer is not None) == balancer
    finally:
        state.close()


def test_idle_tasks_follow_the_needs():
    for model, idle in [
        ("dlrm_torch", ["start_input_dist", "wait_input_dist", "prefetch_embeddings", "finalize_model_grads"]),
        ("hstu_small", ["finalize_model_grads"]),
    ]:
        run = load_run("pipeline=hstu_prefetch", f"model={model}")
        reasons = idle_tasks(training_plan(run, resolve_fn=structure_only), run)
        assert sorted(reasons) == sorted(idle), model
    assert reasons["finalize_model_grads"].startswith("torch DDP all-reduces the gradients during backward")


def test_the_forward_task_is_found_by_its_registry_entry():
    run = load_run("model.loss_normalization=global_tokens")

    def derived(**fns: str) -> list[str]:
        tasks = {n: task.model_copy(update={"fn": fns.get(n, task.fn)}) for n, task in run.pipeline.tasks.items()}
        return list(derive_plan(run.pipeline.model_copy(update={"tasks": tasks}), run).tasks)

    assert derived().index("global_tokens_allreduce") == derived().index("forward") - 1
    # by import path (imported: the default) it is the same task
    by_path = derived(forward="recsys_pipe.train.tasks:forward")
    assert by_path.index("global_tokens_allreduce") == by_path.index("forward") - 1
    # a task called forward that runs another function is not the forward task
    with pytest.raises(ConfigError, match="global_tokens needs a task running forward"):
        derived(forward="backward", backward="optimizer_step")
    # the derived task is named as plans name it
    plan = derive_plan(run.pipeline, run)
    assert plan.tasks["global_tokens_allreduce"].fn == "global_tokens_allreduce"


# -- what must not come back --------------------------------------------------------------


SOURCES = sorted(Path(recsys_pipe.__file__).parent.rglob("*.py"))


def _strings(tree: ast.AST) -> list[str]:
    """The string constants of a module other than its docstrings (which may name modules)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


def test_no_module_names_a_task_by_its_import_path():
    """Behaviour is decided by registry entries: no source string spells a task module or a task's
    import path, except the training package's list of its task modules."""
    modules = {spec.fn.__module__ for spec in map(TASKS.lookup, TASKS.names)}
    train = Path(recsys_pipe.__file__).parent / "train" / "__init__.py"
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for text in _strings(tree):
            if path == train and text in modules:
                continue  # TASK_MODULES
            for module in modules:
                assert module not in text, f"{path}: {text!r}"


def test_no_module_compares_task_functions_or_their_paths():
    """No `task.fn == ...` / `... in plan.fn_paths()` comparisons against names, paths or tables of
    them: ask the registry entry instead. (Identity, `spec.fn is fn`, is how entries are found; a
    message built from `fn`, `fn in str(exc)`, is fine.)"""

    def names_a_task(node: ast.expr) -> bool:
        if isinstance(node, ast.Attribute) and node.attr == "fn":
            return True
        return any(isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "fn_paths" for n in ast.walk(node))

    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and not all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                operands = [node.left, *node.comparators]
                if any(names_a_task(o) for o in operands):
                    others = [o for o in operands if not names_a_task(o)]
                    assert all(isinstance(o, ast.Call) for o in others), f"{path}:{node.lineno} compares a task's fn"
