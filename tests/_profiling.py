"""Per-task ranges in a torch.profiler trace, and reading them back from its Chrome-trace export.

Shared by the CPU trace test and tests/cuda. Two facts shape it:

- torch.profiler (Kineto) records `record_function` ranges, not NVTX ranges: it enables no CUPTI
  marker activity, so the engine's NVTX ranges show in Nsight Systems only. The ranges here come
  from the engine's `RecordFunctionRanges` observer, whose hooks run on the task's thread inside
  its stream scope.
- The profiler is enabled per thread: ranges opened on threads that existed before it started
  (the threaded executor's long-lived workers) are recorded only with
  `_ExperimentalConfig(profile_all_threads=True)` (`profile_all_threads()` below).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from recsys_pipe.engine import Task, TaskGraph


def traced_plan(work: Any) -> TaskGraph:
    """The plan both trace tests profile, each task running `work(ctx)`: `h2d` (memcpy stream,
    lookahead 2, NVTX tag "copy batch"), `dist` (comm stream, lookahead 1), then `forward` and
    `backward` on the default stream, the last writing `step_result`."""
    return TaskGraph.single_group(
        [
            Task.from_fn("h2d", work, stream="memcpy", lookahead=2, writes=["gpu"], nvtx_tag="copy batch"),
            Task.from_fn("dist", work, stream="comm", lookahead=1, reads=["gpu"], writes=["dist"]),
            Task.from_fn("forward", work, reads=["dist"], writes=["loss"]),
            Task.from_fn("backward", work, reads=["loss"], writes=["step_result"]),
        ]
    )


def profile_all_threads() -> Any:
    """The experimental profiler setting that records every thread's ranges, not only the caller's."""
    return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)


def chrome_trace_events(prof: Any, directory: Path) -> list[dict]:
    """The complete ("X") events of the profile's Chrome-trace export."""
    path = Path(directory) / "trace.json"
    prof.export_chrome_trace(str(path))
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def annotations(events: list[dict], labels: set[str]) -> list[dict]:
    """The CPU ranges opened by `record_function` with one of `labels`."""
    return [e for e in events if e.get("cat") == "user_annotation" and e.get("name") in labels]


def kernel_streams_by_label(events: list[dict], labels: set[str]) -> dict[str, set[int]]:
    """For each label, the CUDA streams its kernels ran on.

    A kernel is tied to the host: through its "External id" to the operator or range that was
    innermost when it was launched (both on torch's clock), else through its CUPTI correlation id
    to the runtime call that launched it. It belongs to the innermost range with one of `labels`
    enclosing that host event on the same thread.
    """
    ranges = annotations(events, labels)
    by_external = {
        e["args"]["External id"]: e
        for e in events
        if e.get("cat") in ("cpu_op", "user_annotation") and "External id" in e.get("args", {})
    }
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    streams: dict[str, set[int]] = {}
    for kernel in (e for e in events if e.get("cat") == "kernel"):
        args = kernel.get("args", {})
        host = by_external.get(args.get("External id")) or launches.get(args.get("correlation"))
        if host is None:
            continue
        enclosing = [
            r
            for r in ranges
            if (r["pid"], r["tid"]) == (host["pid"], host["tid"]) and r["ts"] <= host["ts"] <= r["ts"] + r["dur"]
        ]
        if enclosing:
            label = min(enclosing, key=lambda r: r["dur"])["name"]
            streams.setdefault(label, set()).add(args.get("stream", kernel["tid"]))
    return streams
