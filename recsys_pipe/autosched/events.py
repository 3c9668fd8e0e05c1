"""The discrete-event engine shared by the plan simulator and the pipeline-parallel simulator.

A timeline is a set of *spans*: each has a duration, occupies zero or more *resources* while it
runs, and starts no earlier than its constraints allow. A constraint says "start no earlier than
span P's end (or start) plus a lag". Resources come in two kinds:

- `ordered`: spans use it one at a time in the order they were added (a CPU thread running its
  tasks in topological order, a CUDA stream executing kernels in submission order, an NCCL
  communicator serving tickets, a pipeline rank running its action list). The order is part of
  the input, so it is just one more constraint on the previous span.
- `first_come`: one span at a time, granted at run time to whichever asks first (a PCIe link,
  a point-to-point link). Ties go to the span added first.

The engine processes spans in order of start time (a priority queue), so a callback can react
to a span starting and add constraints to spans that are not ready yet (the plan simulator uses
this for a `wait_stream` whose extent depends on what was submitted before). Every span records
the constraint that bound its start, which is what a critical path walks back along. If some
spans can never start (a cycle of waits), `run` raises `Deadlock` naming them.

Why hand-written: the model is small (a few hundred lines) and needs three things general
discrete-event libraries (e.g. SimPy) do not give directly: a pre-declared service order per
resource, start-to-start constraints, and the binding constraint of every start.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Bound", "Deadlock", "EventEngine", "Timeline"]

ORDERED = "ordered"
FIRST_COME = "first_come"


@dataclass(frozen=True)
class Bound:
    """Why a span started when it did: `span` (an id) ended (or started) then, for `reason`."""

    span: int
    reason: str


class Deadlock(RuntimeError):
    """Some spans can never start; `stuck` maps each of their keys to the keys it still waits for."""

    def __init__(self, stuck: dict[Hashable, list[Hashable]]):
        self.stuck = stuck
        shown = "; ".join(
            f"{key} waits for {', '.join(map(str, waits)) or 'a resource'}" for key, waits in list(stuck.items())[:8]
        )
        more = f" (and {len(stuck) - 8} more)" if len(stuck) > 8 else ""
        super().__init__(f"deadlock: {len(stuck)} span(s) can never start: {shown}{more}")


@dataclass(frozen=True)
class Timeline:
    """The result of `EventEngine.run`: start, end and binding constraint of every span, by id."""

    keys: tuple[Hashable, ...]
    resources: tuple[tuple[str, ...], ...]
    start: tuple[float, ...]
    end: tuple[float, ...]
    bound: tuple[Bound | None, ...]
    #: each span's constraints, as (span id, at its end?, lag)
    terms: tuple[tuple[tuple[int, bool, float], ...], ...]
    #: each span's predecessors on its first-come resources (whoever held them before it)
    followed: tuple[tuple[int, ...], ...]


class EventEngine:
    """Build spans and constraints, then `run()` once."""

    def __init__(self) -> None:
        self._policy: dict[str, str] = {}
        self._last_on: dict[str, int] = {}
        self._keys: list[Hashable] = []
        self._duration: list[float] = []
        self._resources: list[tuple[str, ...]] = []
        self._first_come: list[tuple[str, ...]] = []
        self._succ: list[list[tuple[int, bool, float, str]]] = []
        self._pending: list[int] = []
        self._waits_on: list[list[int]] = []
        self._terms: list[list[tuple[int, bool, float]]] = []
        self._followed: list[list[int]] = []
        self._done: list[bool] = []
        self._est: list[float] = []
        self._bound: list[Bound | None] = []
        self._start: list[float] = []
        self._running = False

    def resource(self, name: str, policy: str = ORDERED) -> None:
        """Declare a resource: `"ordered"` (service in the order spans are added) or `"first_come"`."""
        if policy not in (ORDERED, FIRST_COME):
            raise ValueError(f"resource policy must be '{ORDERED}' or '{FIRST_COME}', got {policy!r}")
        self._policy[name] = policy

    def add(self, key: Hashable, duration: float, resources: Sequence[str] = ()) -> int:
        """Add a span; returns its id. On an ordered resource it follows the span added there last."""
        if not (duration >= 0 and math.isfinite(duration)):
            raise ValueError(f"span {key!r}: duration must be a finite number >= 0, got {duration!r}")
        i = len(self._keys)
        self._keys.append(key)
        self._duration.append(float(duration))
        self._resources.append(tuple(resources))
        self._succ.append([])
        self._pending.append(0)
        self._waits_on.append([])
        self._terms.append([])
        self._followed.append([])
        self._done.append(False)
        self._est.append(0.0)
        self._bound.append(None)
        self._start.append(math.nan)
        first_come = []
        for r in resources:
            policy = self._policy.get(r)
            if policy is None:
                raise KeyError(f"span {key!r}: unknown resource {r!r} (declare it with resource())")
            if policy == FIRST_COME:
                first_come.append(r)
            else:
                previous = self._last_on.get(r)
                if previous is not None:
                    self.after(i, previous, reason=f"order on {r}")
                self._last_on[r] = i
        self._first_come.append(tuple(first_come))
        return i

    def after(self, span: int, pred: int, *, at: str = "end", lag: float = 0.0, reason: str = "") -> None:
        """`span` starts no earlier than `pred`'s end (`at="end"`) or start (`at="start"`) plus `lag`.

        May be called from a `run` callback for a span that is not ready yet.
        """
        if at not in ("end", "start"):
            raise ValueError(f"at must be 'end' or 'start', got {at!r}")
        if lag < 0:
            raise ValueError("lag must be >= 0 (the engine processes spans in time order)")
        if self._running and (self._done[span] or self._pending[span] == 0):
            raise RuntimeError(f"span {self._keys[span]!r} is already ready; constrain it before its waits resolve")
        at_end = at == "end"
        self._terms[span].append((pred, at_end, lag))
        if self._done[pred]:
            value = self._start[pred] + (self._duration[pred] if at_end else 0.0) + lag
            self._raise_est(span, value, Bound(pred, reason))
            return
        self._succ[pred].append((span, at_end, lag, reason))
        self._pending[span] += 1
        self._waits_on[span].append(pred)

    def _raise_est(self, span: int, value: float, bound: Bound) -> None:
        # `>=`: of equal candidates the one resolved last is recorded, i.e. the one that released the span
        if value >= self._est[span]:
            self._est[span] = value
            self._bound[span] = bound

    def run(self, on_start: Callable[[int, float], None] | None = None) -> Timeline:
        """Play the timeline. `on_start(span_id, time)` is called as each span starts, before the
        spans waiting on it are released."""
        if self._running:
            raise RuntimeError("an EventEngine runs once")
        self._running = True
        heap = [(self._est[i], i) for i in range(len(self._keys)) if self._pending[i] == 0]
        heapq.heapify(heap)
        free: dict[str, tuple[float, int]] = {}  # first-come resource -> (free from, last occupant)
        duration, start, est, done = self._duration, self._start, self._est, self._done
        remaining = len(self._keys)
        while heap:
            t, i = heapq.heappop(heap)
            if self._first_come[i]:
                holder = max((free.get(r, (0.0, -1)) + (r,) for r in self._first_come[i]), default=None)
                if holder is not None and holder[0] > t:
                    self._est[i] = holder[0]
                    self._bound[i] = Bound(holder[1], f"busy {holder[2]}")
                    heapq.heappush(heap, (holder[0], i))
                    continue
            start[i] = t
            done[i] = True
            remaining -= 1
            end = t + duration[i]
            for r in self._first_come[i]:
                if r in free:
                    self._followed[i].append(free[r][1])
                free[r] = (end, i)
            if on_start is not None:
                on_start(i, t)
            for s, at_end, lag, reason in self._succ[i]:
                value = (end if at_end else t) + lag
                if value >= est[s]:
                    est[s] = value
                    self._bound[s] = Bound(i, reason)
                self._pending[s] -= 1
                if self._pending[s] == 0:
                    heapq.heappush(heap, (est[s], s))
        if remaining:
            stuck = {
                self._keys[i]: [self._keys[p] for p in self._waits_on[i] if not done[p]]
                for i in range(len(self._keys))
                if not done[i]
            }
            raise Deadlock(stuck)
        return Timeline(
            keys=tuple(self._keys),
            resources=tuple(self._resources),
            start=tuple(start),
            end=tuple(s + d for s, d in zip(start, duration)),
            bound=tuple(self._bound),
            terms=tuple(tuple(t) for t in self._terms),
            followed=tuple(tuple(f) for f in self._followed),
        )
