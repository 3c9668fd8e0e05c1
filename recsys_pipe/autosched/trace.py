"""Pictures of measured runs: a Chrome/Perfetto trace and a Gantt timeline of task instances.

The trace uses the Chrome trace event format (a JSON object with `traceEvents`), which
chrome://tracing and https://ui.perfetto.dev open: one complete event (`ph: "X"`) per task
instance, one track per CPU thread (process "host") and, with device timing, one per stream
(process "device"), each event named after its task and tagged with its batch, iteration,
stream, thread, lookahead and nccl flag. The timeline draws the same instances with the
simulator's Gantt code (`gantt.draw_gantt`), rows named like the simulator's resources
(`thread:<id>`, `stream:<name>`), so a measured run and its prediction look alike.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recsys_pipe.autosched.gantt import Bar, draw_gantt
from recsys_pipe.autosched.profiler import TaskInstance

__all__ = ["chrome_trace", "plot_timeline", "write_chrome_trace"]

HOST_PID, DEVICE_PID = 0, 1


def chrome_trace(instances: Sequence[TaskInstance], *, label: str = "recsys_pipe") -> dict[str, Any]:
    """The trace of `instances` as a Chrome trace object (times in µs from the first start)."""
    t0 = min((i.start_s for i in instances), default=0.0)
    threads = list(dict.fromkeys(i.thread for i in instances))
    streams = list(dict.fromkeys(i.stream for i in instances if i.device_start_s is not None))
    events: list[dict[str, Any]] = [
        _meta("process_name", HOST_PID, 0, f"{label} host threads"),
        *(_meta("thread_name", HOST_PID, k, f"thread:{t}") for k, t in enumerate(threads)),
    ]
    if streams:
        events.append(_meta("process_name", DEVICE_PID, 0, f"{label} device streams"))
        events += [_meta("thread_name", DEVICE_PID, k, f"stream:{s}") for k, s in enumerate(streams)]
    for inst in instances:
        args = {
            "batch": inst.batch,
            "iteration": inst.iteration,
            "stream": inst.stream,
            "thread": inst.thread,
            "lookahead": inst.lookahead,
            "nccl": inst.nccl,
        }
        events.append(
            _span(inst.task, "host", HOST_PID, threads.index(inst.thread), inst.start_s, inst.end_s, t0, args)
        )
        if inst.device_start_s is not None and inst.device_end_s is not None:
            tid = streams.index(inst.stream)
            events.append(_span(inst.task, "device", DEVICE_PID, tid, inst.device_start_s, inst.device_end_s, t0, args))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(instances: Sequence[TaskInstance], path: str | os.PathLike, **kwargs: Any) -> Path:
    """Write `chrome_trace(instances)` as JSON to `path`."""
    out = Path(path)
    out.write_text(json.dumps(chrome_trace(instances, **kwargs)))
    return out


def plot_timeline(
    instances: Sequence[TaskInstance],
    path: str | os.PathLike,
    *,
    time_range: tuple[float, float] | None = None,
    title: str | None = None,
) -> Path:
    """Gantt chart of measured task instances.

    Host spans go on `thread:<id>` rows and device spans on `stream:<name>` rows, coloured by
    batch.

    Args:
        instances: what a `CostProfiler` recorded.
        path: the image file to write.
        time_range: the host-clock window to draw, in seconds (default: all).
        title: the chart's title.

    Returns:
        The path of the written image."""
    if time_range is None:
        time_range = (min(i.start_s for i in instances), max(i.end_s for i in instances))
    t0, t1 = time_range
    bars: list[Bar] = []
    for inst in instances:
        bars.append(Bar(f"thread:{inst.thread}", inst.start_s - t0, inst.end_s - t0, inst.task, inst.batch))
        if inst.device_start_s is not None and inst.device_end_s is not None:
            bars.append(
                Bar(f"stream:{inst.stream}", inst.device_start_s - t0, inst.device_end_s - t0, inst.task, inst.batch)
            )
    rows = list(dict.fromkeys(b.row for b in sorted(bars, key=lambda b: (not b.row.startswith("thread:"), b.start))))
    if title is None:
        device = any(i.device_start_s is not None for i in instances)
        title = "measured: host spans per thread" + (", device spans per stream" if device else " (CPU)")
    return draw_gantt(bars, rows, path, title=title, time_range=(0.0, t1 - t0))


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _span(name: str, cat: str, pid: int, tid: int, start: float, end: float, t0: float, args: dict) -> dict[str, Any]:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": round((start - t0) * 1e6, 3),
        "dur": round((end - start) * 1e6, 3),
        "args": args,
    }
