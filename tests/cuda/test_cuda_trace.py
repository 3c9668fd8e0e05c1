"""Per-task ranges on a GPU: the engine's NVTX range around each task, inside its stream scope, and
per-task ranges and kernels in a torch.profiler trace with CUDA activity.

torch.profiler does not record NVTX ranges (see tests/_profiling.py), so the trace test opens
`record_function` ranges from an observer, whose hooks run where the engine's NVTX range is: on
the task's thread, inside its stream scope. It checks what a profile must show for a plan: every
task's range, on every thread, and each task's kernels on the stream the plan gave it.
"""

import threading

import pytest
import torch
from _profiling import (
    annotations,
    chrome_trace_events,
    kernel_streams_by_label,
    profile_all_threads,
    traced_plan,
)
from torch.profiler import ProfilerActivity, profile

import recsys_pipe.engine.plan_runner as plan_runner_module
from recsys_pipe.engine import PlanRunner, RecordFunctionRanges, StreamPool, ThreadedExecutor
from recsys_pipe.engine.testing import cuda_spin

pytestmark = pytest.mark.timeout(120)

BATCHES = 5
EXECUTORS = {"sequential": lambda: "sequential", "threaded": lambda: ThreadedExecutor("by_stream")}


def work(ctx):
    """A little device work on the task's stream: a short spin and a fill."""
    cuda_spin(0.2)
    ctx.slots.set(ctx.task.writes[0].name, torch.full((1024,), float(ctx.batch_index), device="cuda"))


class NvtxProbe:
    """Stands in for the `nvtx` module in the pipeline: logs each range with the current stream."""

    def __init__(self):
        self.ops = []
        self._lock = threading.Lock()

    def push_range(self, label):
        with self._lock:
            self.ops.append(("push", label, threading.current_thread().name, torch.cuda.current_stream()))

    def pop_range(self):
        with self._lock:
            self.ops.append(("pop", None, threading.current_thread().name, torch.cuda.current_stream()))


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_nvtx_range_per_task_inside_its_stream_scope(monkeypatch, executor):
    probe = NvtxProbe()
    monkeypatch.setattr(plan_runner_module, "nvtx", probe)
    task_graph = traced_plan(work)
    pool = StreamPool.create(task_graph.stream_slots, "cuda")
    with PlanRunner(task_graph, pool, EXECUTORS[executor]()) as runner:  # NVTX on: the pool is CUDA
        list(runner.iterate(range(BATCHES)))
    torch.cuda.synchronize()
    stream_of = {t.label: pool.get(t.stream) for t in task_graph.tasks}
    pushes = [op for op in probe.ops if op[0] == "push"]
    assert sorted(op[1] for op in pushes) == sorted(label for label in stream_of for _ in range(BATCHES))
    for _, label, _, current in pushes:
        assert current == stream_of[label], f"NVTX range {label!r} opened outside its task's stream"
    per_thread = {}
    for kind, label, thread, _ in probe.ops:  # balanced and not interleaved on each thread
        stack = per_thread.setdefault(thread, [])
        if kind == "push":
            assert stack == [], f"range {label!r} opened inside {stack}"
            stack.append(label)
        else:
            stack.pop()
    assert all(stack == [] for stack in per_thread.values())


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_profiler_trace_shows_each_task_and_its_kernels_on_its_stream(tmp_path, executor):
    task_graph = traced_plan(work)
    pool = StreamPool.create(task_graph.stream_slots, "cuda")
    labels = {t.label for t in task_graph.tasks}
    with PlanRunner(task_graph, pool, EXECUTORS[executor](), observer=RecordFunctionRanges()) as runner:
        list(runner.iterate(range(2)))  # warm: worker threads started, kernels loaded
        torch.cuda.synchronize()
        with profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], experimental_config=profile_all_threads()
        ) as prof:
            list(runner.iterate(range(BATCHES)))
            torch.cuda.synchronize()
    events = chrome_trace_events(prof, tmp_path)
    ranges = annotations(events, labels)
    assert sorted(r["name"] for r in ranges) == sorted(label for label in labels for _ in range(BATCHES))
    if executor == "threaded":  # one thread per stream: the ranges come from four threads
        assert len({r["tid"] for r in ranges}) == len(task_graph.stream_slots)
    streams = kernel_streams_by_label(events, labels)
    assert set(streams) == labels, f"tasks without kernels in the trace: {labels - set(streams)}"
    assert all(len(s) == 1 for s in streams.values()), streams  # each task's kernels on one stream
    by_stream = {t.stream: streams[t.label] for t in task_graph.tasks}
    assert len({next(iter(s)) for s in by_stream.values()}) == len(task_graph.stream_slots), streams
    assert by_stream["default"] == streams["forward"] == streams["backward"]
