"""CostModel: what each task of a plan costs, the bridge between the profiler and the simulator.

A task has two costs: `cpu_s`, the host time on the CPU thread that submits it, and `device_s`,
the time its work occupies its stream (0 on a CPU-only machine, where streams are no-ops and the
host time is the whole cost). The profiler measures them (medians, with p10/p90 spread); a user
can also write them by hand. The JSON form is the simulator's input:

    {"tasks": {"forward": {"cpu_s": 0.0021, "device_s": 0.0, "nccl": true, ...}, ...},
     "meta": {"plan": "hstu_prefetch", "device": "cpu", ...}}

Only `cpu_s` and `device_s` are required per task; the other fields (stream, thread, lookahead,
nccl, pcie, host_sync, percentiles, means, samples) describe how the costs were measured and
default to unknown (or false).

Two optional top-level fields describe the time of a step that belongs to no task:
`outside_tasks_s` (median) and `outside_tasks_mean_s` (mean), seconds per iteration on the calling
thread (pulling the next batch from the data iterator, rotating the ring, which releases the
trained batch). The profiler measures them; the simulator adds them to every iteration.

Medians describe a typical step; means describe the long run (samples/s is total samples over
total time, a mean). Task times are right-skewed and, on several ranks, move together (a
collective waits for the slowest rank), so the median of a step is larger than the sum of its
tasks' medians; `simulate(..., statistic="mean")` predicts the mean step from the means.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

__all__ = ["CostModel", "Statistic", "TaskCost"]

#: which per-task figure the simulator plays: the median (a typical step) or the mean (the long run)
Statistic = Literal["median", "mean"]


def _check_seconds(obj: object, *names: str) -> None:
    """ValueError unless each named attribute is a finite number of seconds >= 0."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0 (seconds), got {value!r}")


@dataclass(frozen=True)
class TaskCost:
    """Costs of one task, in seconds per instance (one batch)."""

    cpu_s: float
    device_s: float = 0.0
    cpu_p10_s: float | None = None
    cpu_p90_s: float | None = None
    device_p10_s: float | None = None
    device_p90_s: float | None = None
    #: how the task ran when measured (None: unknown, e.g. written by hand)
    stream: str | None = None
    thread: str | None = None
    lookahead: int | None = None
    #: issues collectives: shares the one communicator with every other nccl task
    nccl: bool = False
    #: bound by host<->device copies: contends with other pcie tasks for the link
    pcie: bool = False
    #: the host waits for the task's device work before going on (`.item()`, `.tolist()`, a
    #: blocking copy): its thread stays busy until the device span ends
    host_sync: bool = False
    #: mean host / device time (None: unknown; `statistic="mean"` then uses the median)
    cpu_mean_s: float | None = None
    device_mean_s: float | None = None
    #: measured instances behind the medians (0: written by hand)
    samples: int = 0

    def __post_init__(self) -> None:
        _check_seconds(self, "cpu_s", "device_s")

    def to_dict(self) -> dict[str, Any]:
        """The costs as a JSON-ready dict, without the fields that are None (unknown)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def host(self, statistic: Statistic = "median") -> float:
        """Host seconds per instance: the median (`cpu_s`), or the mean when known."""
        return self.cpu_mean_s if statistic == "mean" and self.cpu_mean_s is not None else self.cpu_s

    def device(self, statistic: Statistic = "median") -> float:
        """Device seconds per instance: the median (`device_s`), or the mean when known."""
        return self.device_mean_s if statistic == "mean" and self.device_mean_s is not None else self.device_s

    @classmethod
    def from_dict(cls, data: dict[str, Any], task: str = "?") -> TaskCost:
        """The `TaskCost` a `to_dict()` (or a hand-written costs file) describes.

        Args:
            data: a mapping with at least `cpu_s` and `device_s`, and any other field of the class.
            task: the task's name, for the error messages.

        Returns:
            The costs; ValueError naming the task and the field when `data` lacks one or has an
            unknown one."""
        if not isinstance(data, dict):
            raise ValueError(f"task '{task}': expected an object with cpu_s and device_s, got {data!r}")
        missing = [k for k in ("cpu_s", "device_s") if k not in data]
        if missing:
            raise ValueError(f"task '{task}': missing required field(s) {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"task '{task}': unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"task '{task}': {exc}") from None


@dataclass
class CostModel:
    """Per-task costs of one plan (`tasks`: name -> TaskCost), the time per iteration outside
    any task (`outside_tasks_s` median, `outside_tasks_mean_s` mean; 0 and None when unknown),
    plus free-form `meta`."""

    tasks: dict[str, TaskCost] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    outside_tasks_s: float = 0.0
    outside_tasks_mean_s: float | None = None

    def __post_init__(self) -> None:
        _check_seconds(self, "outside_tasks_s")
        if self.outside_tasks_mean_s is not None:
            _check_seconds(self, "outside_tasks_mean_s")

    def outside(self, statistic: Statistic = "median") -> float:
        """Seconds per iteration outside any task: the median, or the mean when known."""
        if statistic == "mean" and self.outside_tasks_mean_s is not None:
            return self.outside_tasks_mean_s
        return self.outside_tasks_s

    def __getitem__(self, task: str) -> TaskCost:
        try:
            return self.tasks[task]
        except KeyError:
            raise KeyError(f"no cost for task '{task}' (have: {', '.join(self.tasks) or 'none'})") from None

    def __contains__(self, task: object) -> bool:
        return task in self.tasks

    def to_json(self, path: str | os.PathLike | None = None, indent: int = 2) -> str:
        """The JSON text; also written to `path` when given."""
        data: dict[str, Any] = {"tasks": {n: c.to_dict() for n, c in self.tasks.items()}}
        if self.outside_tasks_s or self.outside_tasks_mean_s is not None:
            data["outside_tasks_s"] = self.outside_tasks_s
        if self.outside_tasks_mean_s is not None:
            data["outside_tasks_mean_s"] = self.outside_tasks_mean_s
        data["meta"] = self.meta
        text = json.dumps(data, indent=indent)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, source: str | os.PathLike) -> CostModel:
        """Load from a path or from JSON text; raises ValueError naming the task and field."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            path = Path(source)
            try:
                text = path.read_text()
            except OSError as exc:
                raise ValueError(f"cannot read cost model {path}: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"cost model is not valid JSON: line {exc.lineno} column {exc.colno}: {exc.msg}") from None
        if not isinstance(data, dict) or not isinstance(data.get("tasks"), dict):
            raise ValueError('cost model JSON must be an object with a "tasks" object')
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError('"meta" must be an object')
        unknown = sorted(set(data) - {"tasks", "meta", "outside_tasks_s", "outside_tasks_mean_s"})
        if unknown:
            raise ValueError(
                f"unknown top-level field(s) {', '.join(unknown)}; known: tasks, outside_tasks_s, "
                "outside_tasks_mean_s, meta"
            )
        tasks = {name: TaskCost.from_dict(c, name) for name, c in data["tasks"].items()}
        return cls(tasks, dict(meta), data.get("outside_tasks_s", 0.0), data.get("outside_tasks_mean_s"))
