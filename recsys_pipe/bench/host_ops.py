"""What the host does per training step, task by task: the aten operators it dispatches, those
that launch a device kernel, and the host syncs (`recsys-bench train --host`).

On a GPU the host's time per step is about (operators launched) x (cost of one dispatch and
launch) + the syncs + Python; a step is device-bound when that is below the GPU's busy time.
The operators are counted where they reach the backends (a `TorchDispatchMode` pushed on each
task's thread for the task's span, by a `TaskObserver`; the autograd engine's threads inherit
it), so every operator of the forward, the backward, the optimizer and of torchrec's input
distribution counts, views and allocations included, and only those, the Python around them
not. An operator "launches" unless it is a view, an allocation or metadata (`NO_KERNEL`),
which on a GPU queue no kernel.

A host sync is an operator that makes the host wait for the device on CUDA: a read of a device
value (`.item()`: `_local_scalar_dense`; `.tolist()`, `.cpu()`: a copy to the host), a copy
from host memory to the device that is not asynchronous (`torch.tensor(data, device=...)`, a
`.to(device)` of pageable memory), an operator whose output size depends on the data
(`nonzero`, boolean masks, `repeat_interleave` without `output_size`, `unique`). Each is
counted with the place that called it (the first frame outside torch). On the CPU every tensor
is a host tensor, so there the operators that would sync where their inputs are device tensors
are counted (`_local_scalar_dense` and `tolist` of any tensor, every tensor made from host
data, every data-dependent size): an upper bound, which names the call sites to review (a
`.item()` of a CPU-side counter, such as fbgemm's iteration count, syncs nothing on a GPU).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recsys_pipe.engine import Task, TaskScopes

__all__ = ["NO_KERNEL", "HostOps", "launches", "sync_kind"]

aten = torch.ops.aten

#: operators that queue no kernel on a GPU: allocations, aliasing and metadata
NO_KERNEL = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.detach.default,
        aten.lift_fresh.default,
        aten._unsafe_view.default,
        aten.set_.source_Storage,
        aten.set_.source_Storage_storage_offset,
        aten._local_scalar_dense.default,
    }
)

#: operators whose output size depends on the data: the host reads a device value to size it
DATA_DEPENDENT = frozenset(
    {
        aten.nonzero.default,
        aten.masked_select.default,
        aten._unique2.default,
        aten.unique_dim.default,
        aten.unique_consecutive.default,
    }
)


def launches(func: Any) -> bool:
    """Whether operator `func` queues a kernel on a GPU (not a view, allocation or metadata, and
    not the profiler's range markers)."""
    return not (func.is_view or func in NO_KERNEL or func.namespace == "profiler")


def sync_kind(func: Any, args: tuple, kwargs: dict, device_run: bool) -> str | None:
    """Why `func(*args, **kwargs)` makes the host wait for the device (None: it does not).

    Args:
        device_run: the run trains on a GPU; False on the CPU, where every operator that would
            sync were its tensors on the device is counted (see the module docstring)."""
    if func in (aten._to_copy.default, aten.copy_.default):
        source, target = _copy_devices(func, args, kwargs)
        if source is None or target is None or source == target:
            return None
        if source.type != "cpu":
            return "copy to the host"
        host = args[1] if func is aten.copy_.default else args[0]
        non_blocking = kwargs.get("non_blocking", func is aten.copy_.default and len(args) > 2 and bool(args[2]))
        return None if non_blocking and host.is_pinned() else "blocking copy to the device"
    if device_run and not any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in _tensors(args)):
        return None  # host tensors only: nothing to wait for
    if func is aten._local_scalar_dense.default:
        return "item"
    if func is aten.lift_fresh.default:  # on the CPU: a tensor made from host data (on a GPU its copy counts)
        return "tensor from host data"
    if func in DATA_DEPENDENT or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
        return "data-dependent size"
    if func is aten.index.Tensor and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
    ):
        return "data-dependent size"
    return None


def _tensors(args: tuple) -> list[Any]:
    out = []
    for a in args:
        out.extend(a if isinstance(a, (list, tuple)) else (a,))
    return out


def _copy_devices(func: Any, args: tuple, kwargs: dict) -> tuple[torch.device | None, torch.device | None]:
    if func is aten._to_copy.default:
        target = kwargs.get("device")
        return args[0].device, (torch.device(target) if target is not None else None)
    return args[1].device, args[0].device  # copy_(self=target, src)


def _caller() -> str:
    """Where an operator was called from: `file:line` of the innermost frame outside torch and
    this module, and of its caller (`a <- b`; each path cut to its last three parts)."""
    frame, sites = sys._getframe(2), []
    while frame is not None and len(sites) < 2:
        name = frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in name and name != __file__:
            sites.append(f"{os.sep.join(name.split(os.sep)[-3:])}:{frame.f_lineno}")
        frame = frame.f_back
    return " <- ".join(sites) or "?"


class _Counting(TorchDispatchMode):
    """Counts the operators dispatched under it into one task's tallies."""

    def __init__(self, tally: _Tally, device_run: bool):
        super().__init__()
        self.tally, self.device_run = tally, device_run

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.paused:
            self.tally.count(func, args, kwargs, self.device_run)
        return func(*args, **kwargs)

    paused = 0  # > 0 inside a Triton launch: its interpreter's operators are not the step's


class _Tally:
    """One task's operators, launches and sync sites (over the counted steps); thread-safe."""

    def __init__(self) -> None:
        self.ops: collections.Counter[str] = collections.Counter()
        self.launches = 0
        self.syncs: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()

    def count(self, func: Any, args: tuple, kwargs: dict, device_run: bool) -> None:
        kind = sync_kind(func, args, kwargs, device_run)
        site = _caller() if kind is not None else ""
        with self._lock:
            self.ops[str(func.overloadpacket)] += 1
            self.launches += launches(func)
            if kind is not None:
                self.syncs[(kind, site)] += 1

    def sync(self, kind: str, site: str) -> None:
        with self._lock:
            self.syncs[(kind, site)] += 1

    def launch(self, name: str) -> None:
        """A kernel launched outside the dispatcher (a Triton kernel)."""
        with self._lock:
            self.ops[name] += 1
            self.launches += 1


class HostOps(TaskScopes):
    """Counts, per task, what the host does in internal iterations `[first, stop)` (see the module
    docstring). Install it as a plan runner's observer; `report(steps)` divides by the steps.

    `tolist()` does not reach the dispatcher for a host tensor, so while counting,
    `torch.Tensor.tolist` is wrapped to count itself (`counting()`: a context around the run).
    """

    def __init__(self, first: int, stop: int, device_run: bool):
        super().__init__()
        self.first, self.stop, self.device_run = first, stop, device_run
        self.tallies: dict[str, _Tally] = collections.defaultdict(_Tally)
        self._active = False
        self._profile: _DeviceTime | None = None
        #: CUDA: the device's busy time over the counted iterations (ms), and the syncs CUDA itself reported
        self.gpu_ms: float | None = None
        self.sync_warnings: list[str] = []

    def iteration_started(self, iteration: int) -> None:
        self._active = self.first <= iteration < self.stop
        if iteration == self.first and self.device_run:
            self._profile = _DeviceTime()
            torch.cuda.set_sync_debug_mode("warn")

    def iteration_finished(self, iteration: int, failed: bool) -> None:
        if iteration == self.stop - 1 and self._profile is not None:
            torch.cuda.set_sync_debug_mode("default")
            self.gpu_ms = self._profile.stop()
            self._profile = None

    def task_scope(self, task: Task, batch_index: int) -> _Counting | None:
        return _Counting(self.tallies[task.name], self.device_run) if self._active else None

    def counting(self) -> Any:
        """A context around the run: `torch.Tensor.tolist` wrapped to count its calls in counted
        tasks; on CUDA, the warnings of `torch.cuda.set_sync_debug_mode` collected."""
        return _Counted(self)

    def report(self, steps: int) -> dict[str, Any]:
        """Per step: operators, launches and syncs, in total and by task; the sync sites; the
        most frequent operators."""
        by_task = {
            name: {
                "ops": round(sum(t.ops.values()) / steps, 1),
                "launches": round(t.launches / steps, 1),
                "syncs": round(sum(t.syncs.values()) / steps, 1),
            }
            for name, t in self.tallies.items()
        }
        sites: collections.Counter[str] = collections.Counter()
        ops: collections.Counter[str] = collections.Counter()
        for name, t in self.tallies.items():
            for (kind, site), n in t.syncs.items():
                sites[f"{name}: {kind} at {site}"] += n
            ops.update(t.ops)
        device = {}
        if self.gpu_ms is not None:
            device = {
                "gpu_ms_per_step": round(self.gpu_ms / steps, 3),
                "cuda_sync_warnings_per_step": round(len(self.sync_warnings) / steps, 2),
            }
        return {
            **device,
            "ops_per_step": round(sum(r["ops"] for r in by_task.values()), 1),
            "launches_per_step": round(sum(r["launches"] for r in by_task.values()), 1),
            "syncs_per_step": round(sum(r["syncs"] for r in by_task.values()), 1),
            "by_task": by_task,
            "sync_sites": {site: round(n / steps, 2) for site, n in sites.most_common()},
            "top_ops": {op: round(n / steps, 1) for op, n in ops.most_common(12)},
        }


class _DeviceTime:
    """torch.profiler over the counted iterations: the summed duration of the device's kernels
    and copies (its busy time, whatever the host does; the profiler's own host cost does not
    change it)."""

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        self.profiler = profile(activities=[ProfilerActivity.CUDA])
        self.profiler.__enter__()

    def stop(self) -> float:
        torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        events = [e for e in self.profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return sum(e.device_time for e in events) / 1e3


class _Counted:
    """While entered: `torch.Tensor.tolist` counts itself as a sync of the task that calls it (a
    host tensor's does not reach the dispatcher), and CUDA's sync warnings are collected."""

    def __init__(self, host: HostOps):
        self.host = host
        self.original: Callable[..., Any] | None = None
        self.warnings: Any = None

    def __enter__(self) -> None:
        host, original = self.host, torch.Tensor.tolist
        self.original = original

        def tolist(tensor: torch.Tensor) -> Any:
            mode = host.open_scope()
            if mode is not None and tensor.device.type == "cpu" and not host.device_run:
                mode.tally.sync("tolist", _caller())
            return original(tensor)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        self.triton = _triton_launches(host)
        if host.device_run:
            self.warnings = warnings.catch_warnings(record=True)
            caught = self.warnings.__enter__()
            warnings.simplefilter("always")
            host.sync_warnings = caught

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self.original  # type: ignore[method-assign]
        for owner, name, original in self.triton:
            setattr(owner, name, original)
        if self.warnings is not None:
            caught = list(self.host.sync_warnings)
            self.warnings.__exit__(*exc)
            self.host.sync_warnings = [str(w.message) for w in caught if "synchroniz" in str(w.message)]


def _triton_launches(host: HostOps) -> list[tuple[type, str, Any]]:
    """Make every Triton kernel launch in a counted task count as one launch (the operators its
    interpreter runs on the CPU do not count); returns what to put back. Nothing where Triton
    does not import."""
    try:
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    patched = []
    for owner in (JITFunction, Autotuner, *_interpreted()):
        original = owner.run

        def run(kernel: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            mode = host.open_scope()
            if mode is None:
                return _original(kernel, *args, **kwargs)
            if not mode.paused:  # the outermost of an autotuner and its kernel
                fn = getattr(kernel, "base_fn", kernel)
                mode.tally.launch(f"triton.{getattr(fn, '__name__', type(kernel).__name__)}")
            mode.paused += 1
            try:
                return _original(kernel, *args, **kwargs)
            finally:
                mode.paused -= 1

        owner.run = run
        patched.append((owner, "run", original))
    return patched


def _interpreted() -> tuple[type, ...]:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return ()
    return (InterpretedFunction,)
