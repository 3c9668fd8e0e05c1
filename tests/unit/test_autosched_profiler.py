"""Cost profiling on synthetic tasks of known duration (GIL-releasing sleeps): measured host
costs, exposed times on a serial and a plan with lookaheads, the device-event path with a recording
timer, and the trace and timeline files."""

import json
import threading
import time

import pytest

from recsys_pipe.autosched import (
    CostModel,
    CostProfiler,
    TaskProfiler,
    chrome_trace,
    plot_timeline,
    simulate,
    write_chrome_trace,
)
from recsys_pipe.engine import PlanRunner, StreamPool, Task, TaskGraph, ThreadedExecutor

pytestmark = pytest.mark.timeout(120)

# On the plan with lookaheads `a` and `b` run on the calling thread (50 ms per iteration), `load`
# one batch ahead on its own thread (15 ms): load overlaps them, a and b are the critical path.
DURATIONS = {"load": 0.015, "a": 0.030, "b": 0.020}
TOLERANCE = 0.10
#: and an absolute slack: a sleep's wake-up comes a few ms late when other jobs load the 2 cores
SLACK = 0.003


def sleeper(seconds):
    def run(ctx):
        time.sleep(seconds)
        for slot in ctx.task.writes:
            ctx.ring.at(slot.batch_offset).set(slot.name, ctx.batch_index)

    return run


def plan(lookaheads: bool) -> TaskGraph:
    la = 1 if lookaheads else 0
    return TaskGraph.single_group(
        [
            Task.from_fn("load", sleeper(DURATIONS["load"]), lookahead=la, stream="io", writes=["x"]),
            Task.from_fn("a", sleeper(DURATIONS["a"]), reads=["x"], writes=["y"]),
            Task.from_fn("b", sleeper(DURATIONS["b"]), reads=["y"], writes=["step_result"]),
        ]
    )


def plan_runner(lookaheads: bool) -> PlanRunner:
    executor = ThreadedExecutor({"load": "io", "default": "compute"}) if lookaheads else "sequential"
    return PlanRunner(plan(lookaheads), executor=executor)


@pytest.fixture(scope="module")
def results():
    """Both plans profiled once (about 5 s of sleeping), shared by the checks below."""
    out = {}
    for name, lookaheads in (("serial", False), ("lookahead", True)):
        with plan_runner(lookaheads) as runner:
            profiler = TaskProfiler(runner, lambda: range(12), warmup=2, iters=8)
            out[name] = profiler.profile_many()
    return out


@pytest.mark.parametrize("plan_name", ["serial", "lookahead"])
def test_measured_cpu_time_is_the_task_duration(results, plan_name):
    costs = results[plan_name].costs
    assert list(costs.tasks) == ["load", "a", "b"]
    for name, seconds in DURATIONS.items():
        cost = costs[name]
        assert cost.cpu_s == pytest.approx(seconds, rel=TOLERANCE, abs=SLACK), name
        assert cost.device_s == 0.0 and cost.samples == 8
        assert cost.cpu_p10_s <= cost.cpu_s <= cost.cpu_p90_s


def test_costs_record_how_each_task_ran(results):
    serial, lookaheads = results["serial"].costs, results["lookahead"].costs
    assert {n: (c.thread, c.stream, c.lookahead) for n, c in serial.tasks.items()} == {
        "load": ("main", "io", 0),
        "a": ("main", "default", 0),
        "b": ("main", "default", 0),
    }
    assert {n: (c.thread, c.lookahead) for n, c in lookaheads.tasks.items()} == {
        "load": ("io", 1),
        "a": ("compute", 0),
        "b": ("compute", 0),
    }
    assert CostModel.from_json(lookaheads.to_json()) == lookaheads  # the simulator's input format


def test_exposed_time_on_the_serial_plan_is_each_tasks_cost(results):
    result = results["serial"]
    assert result.baseline_s == pytest.approx(sum(DURATIONS.values()), rel=TOLERANCE)
    for name, seconds in DURATIONS.items():
        assert result.exposed_s[name] == pytest.approx(seconds, rel=TOLERANCE, abs=SLACK), name


def test_exposed_time_on_the_pipelined_plan_is_what_a_task_adds_to_the_critical_path(results):
    result = results["lookahead"]
    assert result.baseline_s == pytest.approx(DURATIONS["a"] + DURATIONS["b"], rel=TOLERANCE, abs=SLACK)
    assert result.exposed_s["a"] == pytest.approx(DURATIONS["a"], rel=TOLERANCE, abs=SLACK)
    assert result.exposed_s["b"] == pytest.approx(DURATIONS["b"], rel=TOLERANCE, abs=SLACK)
    assert result.exposed_s["load"] < TOLERANCE * DURATIONS["load"] + SLACK  # overlapped: about 0
    assert result.share("a") == pytest.approx(0.6, abs=0.06)


def test_report_and_json(results):
    result = results["lookahead"]
    text = result.report()
    header, rule, *rows = text.splitlines()
    assert header.split() == ["task", "stream", "thread", "la", "cpu", "ms", "device", "ms", "exposed", "ms", "share"]
    assert [r.split()[0] for r in rows[:3]] == ["load", "a", "b"]
    assert rows[3].startswith("iteration: ") and rows[4].startswith("outside tasks: ")
    assert 0 <= result.costs.outside_tasks_s < 0.1 * result.baseline_s  # no data loading here
    data = json.loads(result.to_json())
    assert set(data["exposed_s"]) == {"load", "a", "b"} and data["not_measured"] == {}
    assert data["tasks"]["load"]["thread"] == "io"


def test_profiled_costs_predict_the_measured_iteration(results):
    for name, lookaheads in (("serial", False), ("lookahead", True)):
        result = results[name]
        thread_map = {"load": "io", "default": "compute"} if lookaheads else "sequential"
        predicted = simulate(plan(lookaheads), result.costs, thread_map).iteration_s
        assert predicted == pytest.approx(result.baseline_s, rel=0.05), name


def test_tasks_that_cannot_be_replayed_are_reported_not_measured():
    tasks = [
        Task.from_fn("pure", sleeper(0.001), writes=["x"]),
        Task.from_fn("stateful", sleeper(0.001), reads=["x"], writes=["step_result"], effects="updates a counter"),
    ]
    with PlanRunner(TaskGraph.single_group(tasks)) as runner:
        profiler = TaskProfiler(runner, lambda: range(6), warmup=1, iters=4)
        result = profiler.profile_many()
        with pytest.raises(ValueError, match="'stateful' cannot be shortcut"):
            profiler.profile("stateful")
        with pytest.raises(ValueError, match="a pass needs at least 5"):
            TaskProfiler(runner, lambda: range(4), warmup=1, iters=4).profile_many([])
        assert runner.shortcuts == frozenset() and runner.observer is None
    assert set(result.exposed_s) == {"pure"}
    assert "updates a counter" in result.not_measured["stateful"]
    assert "n/a: task 'stateful' cannot be shortcut" in result.report()


# -- device timing through the event interface, on CPU -------------------------------------------


class RecordingStream:
    """A stream whose scope marks itself current on this thread (what torch.cuda.stream does)."""

    current = threading.local()

    def __init__(self, name):
        self.name = name

    def wait_event(self, event):
        pass

    def wait_stream(self, other):
        pass

    def record_event(self, event=None):
        return None

    def scope(self, label):
        stream = self

        class Scope:
            def __enter__(self):
                RecordingStream.current.name = stream.name

            def __exit__(self, *exc):
                RecordingStream.current.name = None

        return Scope()

    def synchronize(self):
        pass


class RecordingTimer:
    """Timing events that note the stream they were recorded on; time is the host clock, and
    the 'device' lags the host by a fixed 5 ms, so device spans are host spans shifted."""

    LAG = 0.005

    def __init__(self):
        self.events = []
        self.synchronized_at = []
        self.run_finished = False

    def event(self):
        timer = self

        class Event:
            def record(self):
                self.stream = getattr(RecordingStream.current, "name", None)
                self.t = time.perf_counter() + timer.LAG
                timer.events.append(self)

            def elapsed_time(self, other):
                return (other.t - self.t) * 1e3

        return Event()

    def anchor(self):  # device clock == host clock: events complete LAG after they are recorded
        event = self.event()
        event.record()
        return event, event.t

    def synchronize(self):
        self.synchronized_at.append(self.run_finished)


def test_device_spans_come_from_events_on_each_tasks_stream_read_once_after_the_run():
    timer = RecordingTimer()
    streams = StreamPool({name: RecordingStream(name) for name in ("default", "io")})
    with PlanRunner(plan(lookaheads=True), streams, ThreadedExecutor({"load": "io"})) as runner:
        profiler = CostProfiler(warmup=1, iters=3, thread_of={"load": "io", "a": "main", "b": "main"}, timer=timer)
        runner.observer = profiler
        list(runner.iterate(range(5)))
    timer.run_finished = True
    instances = profiler.instances()
    assert timer.synchronized_at == [True]  # one wait for the device, after the run, not per task
    assert len(timer.events) == 1 + 2 * 3 * 3  # the anchor, then a start and an end per task instance
    task_events = {(i.task, i.iteration): i for i in instances}
    assert len(task_events) == 9
    for inst in instances:
        assert inst.device_start_s == pytest.approx(inst.start_s + RecordingTimer.LAG, abs=0.003)
        assert inst.device_s == pytest.approx(inst.cpu_s, abs=0.002)
    streams_of = {e.stream for e in timer.events[1:]}
    assert streams_of == {"default", "io"}
    costs = profiler.cost_model()
    assert costs["a"].device_s == pytest.approx(DURATIONS["a"], rel=TOLERANCE, abs=SLACK)
    assert costs["load"].device_p10_s is not None and costs.meta["device_timing"] is True
    trace = chrome_trace(instances)
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {(0, "thread:main"), (0, "thread:io"), (1, "stream:default"), (1, "stream:io")}
    device = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "device"]
    assert len(device) == 9 and all(e["tid"] == (1 if e["args"]["stream"] == "io" else 0) for e in device)


def test_each_event_pair_is_recorded_on_the_tasks_own_stream():
    timer = RecordingTimer()
    streams = StreamPool({name: RecordingStream(name) for name in ("default", "io")})
    starts = []

    class Spy(CostProfiler):
        def task_started(self, task, batch_index, iteration):
            super().task_started(task, batch_index, iteration)
            starts.append((task.stream, self._events[task.name, iteration][0].stream))

    with PlanRunner(plan(lookaheads=True), streams) as runner:
        runner.observer = Spy(warmup=0, iters=4, timer=timer)
        list(runner.iterate(range(3)))
    assert starts and all(task_stream == event_stream for task_stream, event_stream in starts)


# -- files ---------------------------------------------------------------------------------------


def test_trace_file_parses_with_one_track_per_thread(results, tmp_path):
    result = results["lookahead"]
    path = write_chrome_trace(result.instances, tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 3 * 8 and {e["cat"] for e in spans} == {"host"}
    tracks = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(tracks.values()) == ["thread:compute", "thread:io"]
    for e in spans:
        assert tracks[e["tid"]] == f"thread:{e['args']['thread']}"
        assert {"batch", "iteration", "stream", "lookahead"} <= set(e["args"])
        assert e["dur"] > 0 and e["ts"] >= 0
    loads = sorted((e["ts"], e["args"]["batch"]) for e in spans if e["name"] == "load")
    assert [b for _, b in loads] == sorted(b for _, b in loads)  # batches in order


def test_timeline_png(results, tmp_path):
    result = results["lookahead"]
    start, end = result.window(last=3)
    assert end - start == pytest.approx(3 * result.baseline_s, rel=0.1)
    path = plot_timeline(result.instances, tmp_path / "timeline.png", time_range=(start, end))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
