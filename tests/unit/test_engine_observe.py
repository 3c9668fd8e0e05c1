"""Observers: hooks around iterations and tasks, where they run, and the span recorder."""

import threading

import pytest
from _task_graphs import Trace, build

import recsys_pipe.engine.plan_runner as plan_runner_module
from recsys_pipe.engine import (
    PlanRunner,
    PlanRunnerBrokenError,
    SpanRecorder,
    Task,
    TaskFailedError,
    TaskGraph,
    TaskObserver,
    TaskScopes,
    ThreadedExecutor,
)
from recsys_pipe.engine.testing import StreamOp, check_happens_before, recording_pool

pytestmark = pytest.mark.timeout(120)

SPECS = [
    {"name": "h2d", "lookahead": 2, "stream": "s1", "reads": ["batch_cpu"], "writes": ["gpu"]},
    {"name": "dist", "lookahead": 1, "stream": "s2", "reads": ["gpu"], "writes": ["dist"]},
    {"name": "fwd", "lookahead": 0, "reads": ["dist"], "writes": ["loss"]},
    {"name": "bwd", "lookahead": 0, "reads": ["loss"], "writes": ["step_result"], "same_progress_sync": ["dist"]},
]
EXECUTORS = {
    "sequential": lambda: "sequential",
    "by_stream": lambda: ThreadedExecutor("by_stream"),
    "per_task": lambda: ThreadedExecutor("per_task"),
}


class Calls(TaskObserver):
    """Logs every hook with the thread it ran on."""

    def __init__(self):
        self.calls = []
        self._lock = threading.Lock()

    def _log(self, *entry):
        with self._lock:
            self.calls.append((*entry, threading.current_thread().name))

    def iteration_started(self, iteration):
        self._log("iteration_started", iteration)

    def task_started(self, task, batch_index, iteration):
        self._log("task_started", task.name, batch_index, iteration)

    def task_finished(self, task, batch_index, iteration, failed):
        self._log("task_finished", task.name, batch_index, iteration, failed)

    def tasks_done(self, iteration):
        self._log("tasks_done", iteration)

    def iteration_finished(self, iteration, failed):
        self._log("iteration_finished", iteration, failed)


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_hooks_bracket_every_task_and_iteration(executor):
    calls = Calls()
    trace = Trace(jitter=0.001)
    m = 5
    with PlanRunner(build(SPECS, trace), executor=EXECUTORS[executor](), observer=calls) as runner:
        assert len(list(runner.iterate(range(m)))) == m
    caller = threading.current_thread().name
    iterations = m + 2  # two prefill iterations, the drain overlaps them
    assert [c[1] for c in calls.calls if c[0] == "iteration_started"] == list(range(iterations))
    assert [c[1:3] for c in calls.calls if c[0] == "iteration_finished"] == [(i, False) for i in range(iterations)]
    assert all(c[-1] == caller for c in calls.calls if c[0].startswith("iteration") or c[0] == "tasks_done")
    # tasks_done: once per iteration, after its last task and right before iteration_finished
    for i in range(iterations):
        done = calls.calls.index(("tasks_done", i, caller))
        assert calls.calls[done + 1][:3] == ("iteration_finished", i, False)
        assert all(c[3] > i for c in calls.calls[done + 1 :] if c[0] == "task_finished")
        assert any(c[3] == i for c in calls.calls[:done] if c[0] == "task_finished")
    started = {c[1:4]: c[4] for c in calls.calls if c[0] == "task_started"}
    finished = {c[1:4]: c[5] for c in calls.calls if c[0] == "task_finished"}
    assert (
        sorted(started)
        == sorted(finished)
        == sorted((s["name"], b, b + 2 - s["lookahead"]) for s in SPECS for b in range(m))
    )
    assert started == finished  # a task's hooks run on the thread that ran it
    for key in started:  # nested: iteration_started < task_started < task_finished < iteration_finished
        position = [i for i, c in enumerate(calls.calls) if c[1:4] == key]
        (iteration_start,) = [i for i, c in enumerate(calls.calls) if c[:2] == ("iteration_started", key[2])]
        (iteration_end,) = [i for i, c in enumerate(calls.calls) if c[:2] == ("iteration_finished", key[2])]
        assert iteration_start < position[0] < position[1] < iteration_end
    if executor == "per_task":
        assert len(set(started.values())) == len(SPECS)


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_task_scopes_hold_a_context_around_each_chosen_task_on_its_thread(executor):
    """A `TaskScopes` context is entered before the task runs and left after it, on the task's
    thread, where the task finds it (`open_scope`); tasks it chose no context for see none."""
    events: list[tuple] = []
    lock = threading.Lock()

    class Scope:
        def __init__(self, name, batch):
            self.key = (name, batch)

        def __enter__(self):
            with lock:
                events.append(("enter", *self.key, threading.current_thread().name))

        def __exit__(self, *exc):
            with lock:
                events.append(("exit", *self.key, threading.current_thread().name))

    class Scopes(TaskScopes):
        def task_scope(self, task, batch_index):
            return None if task.name == "fwd" else Scope(task.name, batch_index)

    scopes = Scopes()
    seen: dict[tuple, tuple] = {}

    def body(ctx):
        scope = scopes.open_scope()
        with lock:
            seen[ctx.task.name, ctx.batch_index] = (scope and scope.key, threading.current_thread().name)
            events.append(("run", ctx.task.name, ctx.batch_index, threading.current_thread().name))

    tasks = [Task.from_fn(s["name"], body, **{k: v for k, v in s.items() if k != "name"}) for s in SPECS]
    graph = TaskGraph.single_group(tasks, ("default", "s1", "s2"))
    with PlanRunner(graph, executor=EXECUTORS[executor](), observer=scopes) as runner:
        list(runner.iterate(range(4)))
    assert len(seen) == len(SPECS) * 4
    for (name, batch), (key, thread) in seen.items():
        if name == "fwd":
            assert key is None
            continue
        assert key == (name, batch)
        mine = [e[0] for e in events if e[1:3] == (name, batch)]
        assert mine == ["enter", "run", "exit"]
        assert {e[3] for e in events if e[1:3] == (name, batch)} == {thread}


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_task_hooks_run_inside_the_task_stream_context(executor):
    """A profiler records CUDA events in `task_started`/`task_finished`: they must land on the
    task's stream, between its event waits and its completion event."""
    trace = Trace()
    task_graph = build(SPECS, trace)
    pool, log = recording_pool(task_graph.stream_slots)

    class OnStream(TaskObserver):
        def task_started(self, task, batch_index, iteration):
            log.append(StreamOp(task.stream, "observer_start", (task.name, batch_index)))

        def task_finished(self, task, batch_index, iteration, failed):
            log.append(StreamOp(task.stream, "observer_end", (task.name, batch_index)))

    with PlanRunner(task_graph, pool, EXECUTORS[executor](), observer=OnStream()) as runner:
        list(runner.iterate(range(4)))
    by_label: dict = {}
    for op in log.ops:
        if op.kind in ("begin", "observer_start", "observer_end", "end"):
            by_label.setdefault(tuple(op.arg), []).append((op.kind, op.stream))
    assert len(by_label) == len(SPECS) * 4
    for (name, _), ops in by_label.items():
        stream = next(s.get("stream", "default") for s in SPECS if s["name"] == name)
        assert ops == [(k, stream) for k in ("begin", "observer_start", "observer_end", "end")]
    plain = [op for op in log.ops if not op.kind.startswith("observer")]
    log.ops[:] = plain
    assert check_happens_before(log, task_graph) == []


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_failure_is_reported_to_the_observer(executor):
    def body(ctx):
        if ctx.task.name == "fwd" and ctx.batch_index == 1:
            raise RuntimeError("injected")

    tasks = [Task.from_fn(s["name"], body, **{k: v for k, v in s.items() if k != "name"}) for s in SPECS]
    calls = Calls()
    runner = PlanRunner(TaskGraph.single_group(tasks), executor=EXECUTORS[executor](), observer=calls)
    it = iter(range(5))
    with pytest.raises(TaskFailedError, match="task 'fwd' failed on batch 1"):
        list(runner.iterate(it))
    assert ("task_finished", "fwd", 1, 3, True) in [c[:5] for c in calls.calls]
    assert [c[:3] for c in calls.calls if c[0] == "iteration_finished"][-1] == ("iteration_finished", 3, True)
    assert [c[1] for c in calls.calls if c[0] == "tasks_done"] == [0, 1, 2]  # not for the failed iteration
    assert all(c[4] is False for c in calls.calls if c[0] == "task_finished" and c[1:3] != ("fwd", 1))
    with pytest.raises(PlanRunnerBrokenError):
        runner.progress(it)
    runner.shutdown()


def test_observer_attaches_and_detaches_between_steps():
    recorder = SpanRecorder()
    runner = PlanRunner(build(SPECS, Trace()), executor=ThreadedExecutor("by_stream"))
    it = iter(range(8))
    runner.progress(it)  # iterations 0-2, unobserved
    runner.observer = recorder
    assert runner.observer is recorder
    runner.progress(it)  # iteration 3
    runner.progress(it)  # iteration 4
    runner.observer = None
    list(runner.iterate(it))
    assert [s.iteration for s in recorder.iterations()] == [3, 4]
    assert sorted({s.iteration for s in recorder.spans()}) == [3, 4]
    assert len(recorder.spans()) == 2 * len(SPECS)
    with pytest.raises(TypeError, match="TaskObserver"):
        runner.observer = object()
    runner.shutdown()


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_span_recorder_spans_threads_windows_and_clear(executor):
    recorder = SpanRecorder()
    m = 6
    with PlanRunner(build(SPECS, Trace(jitter=0.002)), executor=EXECUTORS[executor](), observer=recorder) as runner:
        list(runner.iterate(range(m)))
    spans = recorder.spans()
    assert sorted((s.task, s.batch_index) for s in spans) == sorted((s["name"], b) for s in SPECS for b in range(m))
    assert all(s.end_s >= s.start_s and s.duration_s >= 0 and not s.failed for s in spans)
    iterations = {it.iteration: it for it in recorder.iterations()}
    assert sorted(iterations) == list(range(m + 2))
    for s in spans:  # every task span lies inside its iteration's span
        assert iterations[s.iteration].start_s <= s.start_s <= s.end_s <= iterations[s.iteration].end_s
        assert s.iteration == s.batch_index + 2 - next(x["lookahead"] for x in SPECS if x["name"] == s.task)
    threads = {s.task: s.thread for s in spans}
    if executor == "sequential":
        assert set(threads.values()) == {threading.current_thread().name}
    elif executor == "by_stream":  # h2d and dist on workers, the default stream (2 tasks) on the caller
        assert threads["fwd"] == threads["bwd"] == threading.current_thread().name
        assert len({threads["h2d"], threads["dist"], threads["fwd"]}) == 3
    else:  # one thread per task; the caller runs the first lookahead-0 task in topological order
        assert threads["fwd"] == threading.current_thread().name
        assert len(set(threads.values())) == 4
    window = recorder.spans(2, 5)
    assert {s.iteration for s in window} == {2, 3, 4}
    assert [s for s in spans if 2 <= s.iteration < 5] == window
    assert [it.iteration for it in recorder.iterations(first=6)] == [6, 7]
    recorder.clear()
    assert recorder.spans() == [] and recorder.iterations() == []


class NvtxLog:
    """Stands in for the `nvtx` module in the plan runner, to see which ranges are opened."""

    def __init__(self):
        self.ops = []

    def push_range(self, label):
        self.ops.append(("push", label))

    def pop_range(self):
        self.ops.append(("pop",))


@pytest.mark.parametrize("nvtx_ranges, expected", [(None, False), (True, True), (False, False)])
def test_nvtx_ranges_only_when_asked_or_on_cuda(monkeypatch, nvtx_ranges, expected):
    ranges = NvtxLog()
    monkeypatch.setattr(plan_runner_module, "nvtx", ranges)

    def body(ctx):
        if ctx.batch_index == 2:
            raise ValueError("boom")

    tasks = [Task.from_fn("a", body, nvtx_tag="tag_a"), Task.from_fn("b", body)]
    runner = PlanRunner(TaskGraph.single_group(tasks), nvtx_ranges=nvtx_ranges)
    with pytest.raises(TaskFailedError):
        list(runner.iterate(range(4)))
    if expected:  # balanced even around the failing task
        assert ranges.ops == [op for _ in range(2) for op in (("push", "tag_a"), ("pop",), ("push", "b"), ("pop",))] + [
            ("push", "tag_a"),
            ("pop",),
        ]
    else:
        assert ranges.ops == []
