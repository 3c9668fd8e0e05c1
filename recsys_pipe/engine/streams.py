"""Named streams and the events that order them.

On CUDA the pool holds real `torch.cuda.Stream`s and records `torch.cuda.Event`s. On a machine
without a GPU every stream and event is a no-op object with the same interface, so the same
task graph runs unchanged on a laptop (and CPU tensors never see `record_stream`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

#: The stream every plan has without declaring it (CUDA's default stream); the one definition,
#: which the plan compiler and the tuner import.
DEFAULT_STREAM = "default"
_NULL_CONTEXT = contextlib.nullcontext()


class NoOpEvent:
    """CPU stand-in for `torch.cuda.Event`: CPU work is already ordered by the CPU."""

    __slots__ = ()

    def record(self, stream: Any = None) -> None:
        """Nothing to record on the CPU."""
        pass

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for on the CPU."""
        pass

    def query(self) -> bool:
        """Always True: CPU work recorded before it has finished."""
        return True

    def synchronize(self) -> None:
        """Returns at once: nothing is pending."""
        pass


_NOOP_EVENT = NoOpEvent()


class NoOpStream:
    """CPU stand-in for `torch.cuda.Stream`."""

    __slots__ = ("name",)

    def __init__(self, name: str = DEFAULT_STREAM):
        self.name = name

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for: the CPU runs work in program order."""
        pass

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for: the CPU runs work in program order."""
        pass

    def record_event(self, event: Any = None) -> NoOpEvent:
        """A `NoOpEvent` (the same shared one every time)."""
        return _NOOP_EVENT

    def synchronize(self) -> None:
        """Returns at once: nothing is pending."""
        pass

    def query(self) -> bool:
        """Always True: nothing is pending."""
        return True

    def __repr__(self) -> str:
        return f"NoOpStream({self.name!r})"


class CudaTimer:
    """Timing events on CUDA streams, for profilers that time tasks on their streams.

    `event()` makes a `torch.cuda.Event(enable_timing=True)`; its `record()` records it on the
    current stream, and `elapsed_time(other)` reads the device time between two recorded
    events, in ms, once both completed. `anchor()` ties device time to host time: it waits for
    the device once, records an event and returns it with `time.perf_counter()` taken when the
    event completed, so a later event's host-clock time is `t + anchor.elapsed_time(event) / 1e3`.
    `synchronize()` waits for every recorded event (once, after a measured run).
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = device

    def event(self) -> torch.cuda.Event:
        """A fresh timing event (`torch.cuda.Event(enable_timing=True)`), not yet recorded."""
        return torch.cuda.Event(enable_timing=True)

    def anchor(self) -> tuple[torch.cuda.Event, float]:
        """An event recorded on an idle device, and the host time it completed at.

        Returns:
            `(event, host_s)`: `host_s + event.elapsed_time(later) / 1e3` is the host-clock time of any
            `later` event recorded after it."""
        torch.cuda.synchronize(self.device)
        event = self.event()
        event.record()
        event.synchronize()
        return event, time.perf_counter()

    def synchronize(self) -> None:
        """Wait for all work on the timer's device (every recorded event has completed)."""
        torch.cuda.synchronize(self.device)


class StreamPool:
    """Streams by name. `use(name)` makes one current; `record_event`/`wait_*` order them.

    Any object with `wait_event`, `wait_stream` and `record_event` works as a stream, which is
    how the recording backend in `recsys_pipe.engine.testing` observes what the engine emits.
    """

    def __init__(self, streams: Mapping[str, Any]):
        if not streams:
            raise ValueError("a StreamPool needs at least one stream")
        self._streams = dict(streams)
        self._cuda = {n for n, s in self._streams.items() if isinstance(s, torch.cuda.Stream)}
        #: each thread's current stream where the streams are not CUDA's (`enter`, `current`)
        self._local = threading.local()

    @classmethod
    def create(cls, names: Iterable[str], device: torch.device | str | None = None) -> StreamPool:
        """Real CUDA streams when `device` is CUDA (`default` is the device's default stream),
        no-op streams otherwise."""
        names = list(dict.fromkeys(names))
        device = torch.device(device) if device is not None else None
        if device is None or device.type != "cuda":
            return cls({n: NoOpStream(n) for n in names})
        streams = {
            n: torch.cuda.default_stream(device) if n == DEFAULT_STREAM else torch.cuda.Stream(device) for n in names
        }
        return cls(streams)

    @property
    def names(self) -> tuple[str, ...]:
        """The stream names, in the order the pool was given them."""
        return tuple(self._streams)

    @property
    def is_cuda(self) -> bool:
        """Whether any stream is a CUDA stream (False: no-op or recording stand-ins)."""
        return bool(self._cuda)

    @property
    def is_noop(self) -> bool:
        """Every stream is a `NoOpStream`: waits, events and stream scopes order nothing, and
        the plan runner skips them."""
        return all(type(s) is NoOpStream for s in self._streams.values())

    def __contains__(self, name: object) -> bool:
        return name in self._streams

    def get(self, name: str) -> Any:
        """The stream called `name` (KeyError naming the pool's streams when there is none)."""
        try:
            return self._streams[name]
        except KeyError:
            raise KeyError(f"stream '{name}' is not in the pool (have: {', '.join(self._streams)})") from None

    def use(self, name: str, label: Any = None) -> AbstractContextManager:
        """Make stream `name` current for the enclosed work. `label` names the work for
        observing backends; real streams ignore it."""
        if name in self._cuda:
            return torch.cuda.stream(self._streams[name])
        scope = getattr(self._streams[name], "scope", None)  # `scope`, inlined: once per task of a no-op pool
        return scope(label) if scope is not None else _NULL_CONTEXT

    def scope(self, name: str, label: Any) -> AbstractContextManager:
        """The span of work `label` on stream `name` for observing backends (a stream object with
        a `scope(label)` method, such as the recording streams of `recsys_pipe.engine.testing`);
        a null context for real and no-op streams. It does not change the current stream."""
        scope = getattr(self._streams[name], "scope", None)
        return scope(label) if scope is not None else _NULL_CONTEXT

    @property
    def has_scopes(self) -> bool:
        """Whether any stream observes spans of work (`scope`)."""
        return any(hasattr(s, "scope") for s in self._streams.values())

    def enter(self, name: str) -> None:
        """Make stream `name` the calling thread's current stream until another `enter` or
        `restore`: unlike `use`, nothing is undone when the work ends, so consecutive work on one
        stream pays for one switch (the plan runner's tasks). On CUDA `torch.cuda.set_stream`
        (which also makes the stream's device current); other streams are tracked per thread, so
        that `current_name` can tell where work would go."""
        if name in self._cuda:
            torch.cuda.set_stream(self._streams[name])
        else:
            self._local.current = name

    def current(self) -> Any:
        """The calling thread's current stream, as `restore` takes it back: a CUDA stream, or the
        name `enter` last gave on this thread (`default` before any)."""
        if self._cuda:
            return torch.cuda.current_stream(self._streams[next(iter(self._cuda))].device)
        return getattr(self._local, "current", DEFAULT_STREAM)

    def restore(self, stream: Any) -> None:
        """Make `stream` (what `current` returned) the calling thread's current stream again."""
        if self._cuda:
            torch.cuda.set_stream(stream)
        else:
            self._local.current = stream

    def current_name(self) -> str | None:
        """The pool's name of the calling thread's current stream (None: not one of the pool's)."""
        current = self.current()
        if not self._cuda:
            return current
        return next((n for n in self._cuda if self._streams[n] == current), None)

    def record_event(self, name: str, event: Any = None) -> Any:
        """Record an event on stream `name` and return it: `event` recorded again where given
        (re-recording reuses the event: a wait already issued on it keeps the earlier record),
        else a new one.

        Returns:
            The event; another stream that `wait_event`s it runs after the work queued on `name` so far."""
        return self._streams[name].record_event(event)

    def wait_event(self, name: str, event: Any) -> None:
        """Make stream `name` wait for `event` (recorded on another stream) before its later work."""
        self._streams[name].wait_event(event)

    def wait_stream(self, name: str, other: str) -> None:
        """Make stream `name` wait for everything queued on stream `other` so far."""
        self._streams[name].wait_stream(self._streams[other])

    def synchronize(self) -> None:
        """Block the calling thread until every stream of the pool is idle."""
        for stream in self._streams.values():
            stream.synchronize()

    def timer(self) -> CudaTimer | None:
        """Timing events for the pool's CUDA streams (see `CudaTimer`); None without CUDA
        streams (CPU work has no device time)."""
        if not self._cuda:
            return None
        return CudaTimer(self._streams[next(iter(self._cuda))].device)

    def __repr__(self) -> str:
        return f"StreamPool({self._streams!r})"
