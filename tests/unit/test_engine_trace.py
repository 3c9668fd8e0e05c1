"""Per-task ranges in a torch.profiler trace, on CPU: what a profile of a threaded plan shows.
(On a GPU, tests/cuda/test_cuda_trace.py also checks each task's kernels and stream.)"""

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

from recsys_pipe.engine import PlanRunner, RecordFunctionRanges, ThreadedExecutor

pytestmark = pytest.mark.timeout(120)

BATCHES = 4


def work(ctx):
    ctx.slots.set(ctx.task.writes[0].name, torch.ones(8) * ctx.batch_index)


def profiled_ranges(tmp_path, **profile_kwargs):
    task_graph = traced_plan(work)
    labels = {t.label for t in task_graph.tasks}
    with PlanRunner(task_graph, executor=ThreadedExecutor("by_stream"), observer=RecordFunctionRanges()) as runner:
        list(runner.iterate(range(2)))  # the worker threads exist before the profiler starts
        with profile(activities=[ProfilerActivity.CPU], **profile_kwargs) as prof:
            list(runner.iterate(range(BATCHES)))
    return labels, annotations(chrome_trace_events(prof, tmp_path), labels)


def test_profile_all_threads_records_every_tasks_range(tmp_path):
    labels, ranges = profiled_ranges(tmp_path, experimental_config=profile_all_threads())
    assert sorted(r["name"] for r in ranges) == sorted(label for label in labels for _ in range(BATCHES))
    threads = {}
    for r in ranges:
        threads.setdefault(r["name"], set()).add(r["tid"])
    assert all(len(t) == 1 for t in threads.values())  # one thread per stream ...
    assert len({next(iter(t)) for t in threads.values()}) == 3  # ... three streams
    assert threads["forward"] == threads["backward"]


def test_by_default_only_the_calling_threads_ranges_are_recorded(tmp_path):
    """Why the profile above needs `profile_all_threads`: torch.profiler is enabled per thread, and
    the executor's workers were started before it (the training step runs on the caller)."""
    _, ranges = profiled_ranges(tmp_path)
    assert sorted({r["name"] for r in ranges}) == ["backward", "forward"]


def test_kernels_are_tied_to_the_task_range_that_launched_them():
    """The trace reading the CUDA trace test relies on, on events shaped like torch's export: a
    kernel reaches its task range through its "External id" (an operator inside the range, or the
    range itself) or, without one, through the runtime call with its correlation id."""
    events = [
        {
            "cat": "user_annotation",
            "name": "h2d",
            "pid": 1,
            "tid": 10,
            "ts": 100,
            "dur": 50,
            "args": {"External id": 1},
        },
        {"cat": "cpu_op", "name": "aten::fill_", "pid": 1, "tid": 10, "ts": 110, "dur": 5, "args": {"External id": 2}},
        {"cat": "user_annotation", "name": "forward", "pid": 1, "tid": 11, "ts": 100, "dur": 50, "args": {}},
        {
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": 1,
            "tid": 11,
            "ts": 120,
            "args": {"correlation": 902},
        },
        {"cat": "cpu_op", "name": "aten::add_", "pid": 1, "tid": 11, "ts": 300, "dur": 5, "args": {"External id": 3}},
        {
            "cat": "kernel",
            "name": "fill",
            "pid": 0,
            "tid": 7,
            "args": {"External id": 2, "correlation": 900, "stream": 7},
        },
        {
            "cat": "kernel",
            "name": "spin",
            "pid": 0,
            "tid": 7,
            "args": {"External id": 1, "correlation": 901, "stream": 7},
        },
        {"cat": "kernel", "name": "gemm", "pid": 0, "tid": 13, "args": {"correlation": 902, "stream": 13}},
        {"cat": "kernel", "name": "outside", "pid": 0, "tid": 13, "args": {"External id": 3, "stream": 13}},
        {"cat": "kernel", "name": "unknown", "pid": 0, "tid": 9, "args": {"correlation": 999, "stream": 9}},
    ]
    assert kernel_streams_by_label(events, {"h2d", "forward"}) == {"h2d": {7}, "forward": {13}}
