"""CostModel: what each task of a plan costs, the bridge between the profiler and the simulator.

A task has two costs: `cpu_s`, the host time on the CPU thread that submits it, and `device_s`,
the time its work occupies its stream (0 on a CPU-only machine, where streams are no-ops and the
host time is the whole cost). The profiler measures them (medians, with p10/p90 spread); a user
can also write them by hand. The JSON form is the simulator's input:

    {"tasks": {"forward": {"cpu_s": 0.0021, "device_s": 0.0, "nccl": true, ...}, ...},
     "meta": {"plan": "hstu_prefetch", "device": "cpu", ...}}

Only `cpu_s` and `device_s` are required per task; the other fields (stream, thread, lookahead,
nccl, pcie, host_sync, percentiles, samples) describe how the costs were measured and default to
unknown (or false).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["CostModel", "TaskCost"]


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
    #: measured instances behind the medians (0: written by hand)
    samples: int = 0

    def __post_init__(self) -> None:
        for name in ("cpu_s", "device_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0 (seconds), got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any], task: str = "?") -> TaskCost:
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
    """Per-task costs of one plan (`tasks`: name -> TaskCost) plus free-form `meta`."""

    tasks: dict[str, TaskCost] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, task: str) -> TaskCost:
        try:
            return self.tasks[task]
        except KeyError:
            raise KeyError(f"no cost for task '{task}' (have: {', '.join(self.tasks) or 'none'})") from None

    def __contains__(self, task: object) -> bool:
        return task in self.tasks

    def to_json(self, path: str | os.PathLike | None = None, indent: int = 2) -> str:
        """The JSON text; also written to `path` when given."""
        text = json.dumps({"tasks": {n: c.to_dict() for n, c in self.tasks.items()}, "meta": self.meta}, indent=indent)
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
        return cls({name: TaskCost.from_dict(c, name) for name, c in data["tasks"].items()}, dict(meta))
