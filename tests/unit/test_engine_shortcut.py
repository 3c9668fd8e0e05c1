"""Shortcut replay: what a skipped task leaves for the tasks after it, values and gradients;
DeclaredIO; refusals; and that a plan runner without shortcuts runs tasks exactly as before."""

import threading

import pytest
import torch

from recsys_pipe.engine import (
    DataSlot,
    DeclaredIO,
    FnTask,
    PlanRunner,
    Task,
    TaskGraph,
    ThreadedExecutor,
    declare_effects,
)
from recsys_pipe.engine.errors import TaskGraphValidationError
from recsys_pipe.engine.shortcut import ShortcutRun, graft

pytestmark = pytest.mark.timeout(60)

EXECUTORS = {"sequential": lambda: "sequential", "threaded": lambda: ThreadedExecutor("per_task")}


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=g) for _ in range(n)]


# -- values --------------------------------------------------------------------------------------


def value_runner(executor, calls):
    """src -> mid (adds, replaces and deletes slots, one of them at lookahead 1) -> out."""

    def src(ctx):
        ctx.slots.set("x", ctx.slots["batch_cpu"] * 2)
        ctx.slots.set("scratch", "from src")

    def mid(ctx):
        calls.append(ctx.batch_index)
        x = ctx.slots["x"]
        ctx.slots.set("y", {"sum": x.sum(0), "parts": [x[0], (x[1], "tag")]})
        ctx.slots.set("x", x + 1)  # replaces a slot it reads
        ctx.slots.pop("scratch")  # deleted

    def out(ctx):
        assert "scratch" not in ctx.slots
        y = ctx.slots["y"]
        ctx.slots.set("step_result", (ctx.batch_index, y["sum"].clone(), y["parts"][1][1], ctx.slots["x"].clone()))

    return PlanRunner(
        TaskGraph.single_group(
            [
                Task.from_fn("src", src, lookahead=1, reads=["batch_cpu"], writes=["x", "scratch"]),
                Task.from_fn("mid", mid, lookahead=1, reads=["x", "scratch"], writes=[DataSlot("y", 1)]),
                Task.from_fn("out", out, reads=["y", "x"], writes=["step_result"]),
            ]
        ),
        executor=EXECUTORS[executor](),
    )


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_replay_gives_later_tasks_what_the_caching_run_produced(executor):
    data = batches(6)
    calls = []
    with value_runner(executor, calls) as runner:
        reference = list(runner.iterate(data))
        calls.clear()
        runner.enable_shortcut(["mid"])
        assert runner.shortcuts == {"mid"}
        replayed = list(runner.iterate(data))
        assert calls == [0]  # ran once (the caching run), then replayed
        runner.disable_shortcut("mid")
        again = list(runner.iterate(data))
    assert calls == [0, *range(6)]
    first = reference[0]
    for index, (batch, total, tag, x) in enumerate(replayed):
        assert batch == index  # later tasks still run on their own batch
        assert torch.equal(total, first[1]) and tag == "tag" and torch.equal(x, first[3])
    assert all(torch.equal(a[1], b[1]) and torch.equal(a[3], b[3]) for a, b in zip(reference, again))


def test_cached_tensors_are_clones_not_the_tasks_own():
    produced = []

    def mid(ctx):
        t = torch.ones(3)
        produced.append(t)
        ctx.slots.set("y", t)

    def out(ctx):
        ctx.slots.set("step_result", ctx.slots["y"].clone())

    runner = PlanRunner(
        TaskGraph.single_group(
            [Task.from_fn("mid", mid, writes=["y"]), Task.from_fn("out", out, reads=["y"], writes=["step_result"])]
        )
    )
    runner.enable_shortcut("mid")
    results = []
    for r in runner.iterate(range(3)):
        results.append(r)
        produced[0].add_(10)  # changing the task's own tensor afterwards does not change the replay
    assert [r.tolist() for r in results] == [[1.0, 1.0, 1.0]] * 3


def test_unknown_names_and_effects_without_io_are_refused():
    @declare_effects("writes the registry")
    def writes_registry(ctx):
        pass

    noop = Task.from_fn("noop", lambda ctx: None)
    effectful = Task.from_fn("effectful", writes_registry)
    assert effectful.effects == "writes the registry" and effectful.io == ()
    runner = PlanRunner(TaskGraph.single_group([noop, effectful]))
    with pytest.raises(KeyError, match="'nope'"):
        runner.enable_shortcut(["noop", "nope"])
    with pytest.raises(ValueError, match=r"task 'effectful' cannot be shortcut: .*: writes the registry"):
        runner.enable_shortcut(["noop", "effectful"])
    assert runner.shortcuts == frozenset()  # nothing enabled by a refused call
    runner.enable_shortcut("noop")
    assert runner.shortcuts == {"noop"}


def test_task_fields_validate_effects_and_io():
    with pytest.raises(TaskGraphValidationError, match="io"):
        Task.from_fn("t", lambda ctx: None, io=[lambda: None])
    with pytest.raises(TaskGraphValidationError, match="effects"):
        Task.from_fn("t", lambda ctx: None, effects="")
    io = DeclaredIO(lambda ctx: None, lambda ctx, v: None)
    assert Task.from_fn("t", lambda ctx: None, effects="x", io=io).io == (io,)
    explicit = Task.from_fn("t", declare_effects("declared")(lambda ctx: None), effects="given")
    assert explicit.effects == "given"  # explicit fields win over the function's declaration


# -- DeclaredIO ---------------------------------------------------------------------------------


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_declared_io_restores_external_state_on_every_replay(executor):
    registry = {}  # state outside the slots: what `register` writes and `consume` reads
    runs = []

    def capture(ctx):
        return {"table": registry["table"], "batch_seen": registry["batch_seen"]}

    def restore(ctx, value):
        registry.update(value)

    @declare_effects("writes the shared registry", DeclaredIO(capture, restore))
    def register(ctx):
        runs.append(ctx.batch_index)
        registry["table"] = ctx.slots["batch_cpu"].sum(0)
        registry["batch_seen"] = ctx.batch_index
        ctx.slots.set("marker", ctx.batch_index)

    def consume(ctx):
        table = registry.pop("table")  # consumes the state: a replay must put it back
        table.mul_(0)  # and may change what it got without reaching the cache
        ctx.slots.set("step_result", (registry.pop("batch_seen"), ctx.slots["marker"]))

    data = batches(5)
    runner = PlanRunner(
        TaskGraph.single_group(
            [
                Task.from_fn("register", register, reads=["batch_cpu"], writes=["marker"]),
                Task.from_fn("consume", consume, reads=["marker"], writes=["step_result"]),
            ]
        ),
        executor=EXECUTORS[executor](),
    )
    with runner:
        runner.enable_shortcut("register")
        results = list(runner.iterate(data))
    assert runs == [0]
    assert results == [(0, 0)] * 5  # the state and the slot of the caching run, every time


def test_declared_io_values_are_fresh_copies():
    seen = []
    state = {}

    def capture(ctx):
        return [state["t"]]

    def restore(ctx, value):
        seen.append(value[0])
        state["t"] = value[0]

    def producer(ctx):
        state["t"] = torch.arange(3.0)

    task = Task.from_fn("p", producer, effects="sets state['t']", io=[DeclaredIO(capture, restore)])
    runner = PlanRunner(TaskGraph.single_group([task]))
    runner.enable_shortcut("p")
    list(runner.iterate(range(4)))
    assert len(seen) == 3
    assert all(torch.equal(t, torch.arange(3.0)) for t in seen)
    assert len({id(t) for t in seen}) == 3 and len({t.data_ptr() for t in seen}) == 3


# -- gradients ----------------------------------------------------------------------------------


class Model:
    """embed (w1) -> mid (w2, the task to skip) -> head (w3); `skip=True` adds a path from the
    embedding straight to the loss that does not pass through mid."""

    def __init__(self, skip: bool):
        g = torch.Generator().manual_seed(1)
        self.w1 = torch.randn(3, 5, generator=g, requires_grad=True)
        self.w2 = torch.randn(5, 5, generator=g, requires_grad=True)
        self.w3 = torch.randn(5, 1, generator=g, requires_grad=True)
        self.skip = skip
        self.mid_runs = 0

    def params(self):
        return (self.w1, self.w2, self.w3)

    def tasks(self):
        def zero_grad(ctx):
            for p in self.params():
                p.grad = None

        def embed(ctx):
            ctx.slots.set("h", ctx.slots["batch_cpu"] @ self.w1)

        def mid(ctx):
            self.mid_runs += 1
            ctx.slots.set("z", torch.tanh(ctx.slots["h"] @ self.w2))

        def head(ctx):
            loss = (ctx.slots["z"] @ self.w3).square().mean()
            if self.skip:
                loss = loss + 0.5 * ctx.slots["h"].square().mean()
            ctx.slots.set("loss", loss)

        def backward(ctx):
            ctx.slots["loss"].backward()
            grads = tuple(None if p.grad is None else p.grad.clone() for p in self.params())
            ctx.slots.set("step_result", (ctx.slots["z"].detach().clone(), grads))

        return [
            Task.from_fn("zero_grad", zero_grad),
            Task.from_fn("embed", embed, reads=["batch_cpu"], writes=["h"], depends_on=["zero_grad"]),
            Task.from_fn("mid", mid, reads=["h"], writes=["z"]),
            Task.from_fn("head", head, reads=["z", "h"], writes=["loss"]),
            Task.from_fn("backward", backward, reads=["loss", "z"], writes=["step_result"]),
        ]


def expected_grads(model, x, z_cached):
    """Gradients when mid's output is the cached z, a constant: only w3 and the skip path."""
    w1, w3 = (p.detach().clone().requires_grad_(True) for p in (model.w1, model.w3))
    loss = (z_cached @ w3).square().mean()
    if model.skip:
        loss = loss + 0.5 * (x @ w1).square().mean()
    loss.backward()
    return (w1.grad if model.skip else torch.zeros_like(w1), torch.zeros_like(model.w2), w3.grad)


@pytest.mark.parametrize("skip", [False, True], ids=["only_through_mid", "with_skip_path"])
@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_replayed_gradients_are_exact_and_upstream_gets_exact_zeros(executor, skip):
    model = Model(skip)
    data = batches(5, seed=3)
    with PlanRunner(TaskGraph.single_group(model.tasks()), executor=EXECUTORS[executor]()) as runner:
        runner.enable_shortcut("mid")
        results = list(runner.iterate(data))
    assert model.mid_runs == 1
    z_cached = results[0][0]
    for x, (z, grads) in list(zip(data, results))[1:]:  # the replays
        assert torch.equal(z, z_cached)
        assert all(g is not None for g in grads)  # every parameter still reached: graph connected
        for got, want in zip(grads, expected_grads(model, x, z_cached)):
            assert torch.equal(got, want)
    # the caching run trained through mid for real: its gradients are not zero
    assert results[0][1][0].abs().sum() > 0 and results[0][1][1].abs().sum() > 0


def test_graft_is_identity_forward_and_zero_backward():
    w = torch.randn(4, requires_grad=True)
    h = w * 3
    restored = torch.arange(4.0)
    out = graft(restored, [h])
    assert torch.equal(out, restored) and out.requires_grad
    (out * torch.arange(4.0)).sum().backward()
    assert torch.equal(w.grad, torch.zeros(4))
    leaf = graft(torch.ones(2), [])
    assert leaf.requires_grad and leaf.is_leaf


def test_replay_under_no_grad_does_not_track():
    w = torch.ones(2, requires_grad=True)

    def make(ctx):
        ctx.slots.set("y", w * 2)

    def read(ctx):
        ctx.slots.set("step_result", ctx.slots["y"].requires_grad)

    runner = PlanRunner(
        TaskGraph.single_group(
            [Task.from_fn("make", make, writes=["y"]), Task.from_fn("read", read, reads=["y"], writes=["step_result"])]
        )
    )
    runner.enable_shortcut("make")
    assert list(runner.iterate(range(2))) == [True, True]
    with torch.no_grad():
        assert list(runner.iterate(range(2))) == [False, False]


# -- no shortcut: nothing in the way -------------------------------------------------------------


def test_without_shortcuts_tasks_run_their_own_run_method():
    ran = []

    class Counting(Task):
        def run(self, ctx):
            ran.append((self.name, threading.current_thread().name))

    tasks = [Counting("a"), Counting("b", depends_on=["a"])]
    runner = PlanRunner(TaskGraph.single_group(tasks))
    records = list(runner._records.values())
    assert [r.run for r in records] == [t.run for t in tasks]
    assert runner._plain  # the per-task path is just `task.run(ctx)`
    runner.enable_shortcut("a")
    assert isinstance(runner._records[tasks[0]].run, ShortcutRun) and not runner._plain
    runner.disable_shortcut("a")
    assert [r.run for r in records] == [t.run for t in tasks]  # back to the task's own method
    assert runner._plain
    list(runner.iterate(range(2)))
    assert [name for name, _ in ran] == ["a", "b", "a", "b"]


def test_fn_task_declaration_survives_replace():
    io = DeclaredIO(lambda ctx: 1, lambda ctx, v: None)
    fn = declare_effects("changes things", io)(lambda ctx: None)
    task = FnTask("t", fn)
    moved = task.replace(lookahead=2)
    assert (moved.effects, moved.io, moved.lookahead) == ("changes things", (io,), 2)
