"""Random valid task graphs (hypothesis), a tracing task body and a cross-stream hand-off plan,
shared by the engine tests (CPU and tests/cuda).

Every generated task reads its declared slots at their declared offsets, writes a value derived
from (its name, its batch, what it read, the raw batch) to every slot it declares, and logs what
it read. Comparing those traces between executors, and against the producer that should have
written each value, checks data flow; the recording streams check ordering.
"""

from __future__ import annotations

import random
import threading
import time

import torch
from hypothesis import strategies as st

from recsys_pipe.engine import DataSlot, Task, TaskGraph, TaskGroup, compile_dependencies
from recsys_pipe.engine.errors import TaskGraphValidationError
from recsys_pipe.engine.testing import cuda_spin

STREAMS = ("default", "s1", "s2")


class Trace:
    """(task, batch) -> what the task read and what it wrote; thread-safe."""

    def __init__(self, jitter: float = 0.0, seed: int = 0):
        self.reads: dict[tuple[str, int], tuple] = {}
        self.writes: dict[tuple[str, int], int] = {}
        self.order: list[tuple[str, int]] = []
        self.jitter = jitter
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def body(self, ctx) -> None:
        task = ctx.task
        if self.jitter:
            with self._lock:
                delay = self._rng.random() * self.jitter
            time.sleep(delay)
        seen = tuple(ctx.ring.at(s.batch_offset).get(s.name) for s in task.reads)
        value = hash((task.name, ctx.batch_index, seen))
        for slot in task.writes:
            ctx.ring.at(slot.batch_offset).set(slot.name, value)
        with self._lock:
            key = (task.name, ctx.batch_index)
            assert key not in self.reads, f"{key} ran twice"
            self.reads[key] = seen
            self.writes[key] = value
            self.order.append(key)


def build(specs: list[dict], trace: Trace, streams=STREAMS) -> TaskGraph:
    tasks = [Task.from_fn(spec["name"], trace.body, **{k: v for k, v in spec.items() if k != "name"}) for spec in specs]
    return TaskGraph(groups=(TaskGroup(tuple(tasks)),), stream_slots=streams)


@st.composite
def task_graph_specs(draw, max_tasks: int = 6, max_lookahead: int = 3, streams=STREAMS) -> list[dict]:
    """Specs of a random task graph that passes validation.

    In-iteration edges (same-offset reads, same-lookahead depends_on, same_progress_sync) only
    point to earlier tasks, so the graph is acyclic; declaration order is then shuffled so the
    topological sort has real work to do. Entries that would break a rule are dropped.
    """
    n = draw(st.integers(1, max_tasks))
    specs: list[dict] = []
    for i in range(n):
        la = draw(st.integers(0, max_lookahead))
        stream = draw(st.sampled_from(streams))
        spec = {
            "name": f"t{i}",
            "lookahead": la,
            "stream": stream,
            "writes": [f"v{i}"],
            "reads": [],
            "depends_on": [],
            "cross_iter_depends_on": [],
            "same_progress_sync": [],
        }
        used: set[str] = set()
        if draw(st.booleans()):
            spec["reads"].append("batch_cpu")
        for p in specs:
            choice = draw(st.sampled_from(["none", "none", "read", "depends_on", "cross_iter", "sync"]))
            pla, pname = p["lookahead"], p["name"]
            cross = p["stream"] != stream
            if choice == "read" and pla >= 0:
                j = draw(st.integers(0, pla))
                delta = pla - j
                if not (cross and pla - delta < 0) and j <= pla:
                    spec["reads"].append(DataSlot(f"v{pname[1:]}", j))
            elif choice == "depends_on" and pla >= la:
                spec["depends_on"].append(pname)
                used.add(pname)
            elif choice == "cross_iter":
                big_n = draw(st.integers(1, 2))
                delta = pla + big_n - la
                offset = la - big_n if delta > 0 else pla
                if delta >= 0 and not (cross and offset < 0):
                    spec["cross_iter_depends_on"].append((pname, -big_n))
            elif choice == "sync":
                spec["same_progress_sync"].append(pname)
        if (draw(st.booleans()) and i == n - 1 or (la == 0 and draw(st.booleans()))) and not any(
            "step_result" in s["writes"] for s in specs
        ):
            spec["writes"].append("step_result")
        specs.append(spec)
    order = draw(st.permutations(range(n)))
    shuffled = [specs[i] for i in order]
    try:
        compile_dependencies(build(shuffled, Trace()))
    except TaskGraphValidationError as exc:  # rule 8 conflicts etc.: fall back to the valid prefix
        raise AssertionError(f"generator produced an invalid task_graph: {exc}") from exc
    return shuffled


HANDOFF_SIZE = 1 << 16  # int64 elements: 512 KiB, one block of the caching allocator's small pool


def handoff_value(batch: int) -> int:
    return 1000 + batch


def handoff_task_graph(record_stream: str, spin_ms: float = 0.0) -> TaskGraph:
    """Memory made on one stream, read on another, dropped by the ring while the read may be queued.

    `make` (lookahead 1, stream "side") allocates a tensor holding `handoff_value(batch)`; `take`
    (lookahead 0, default stream) keeps its stream busy for `spin_ms` (CUDA only), then copies
    the tensor into `step_result`. The ring drops the tensor when `take`'s batch completes, so on
    CUDA the copy may still be queued when the memory goes back to the caching allocator, which
    hands it to the next allocation on the side stream unless it knows another stream uses it.
    `record_stream` says who tells it: "producer" (the pattern of the training h2d task: the
    allocating task, for every other stream of the pool), "consumer" (the reading task, for its
    own stream) or "none". CPU tensors have no streams: nothing is recorded there.
    """
    if record_stream not in ("producer", "consumer", "none"):
        raise ValueError(f"record_stream must be producer, consumer or none, got {record_stream!r}")

    def make(ctx) -> None:
        pool = ctx.stream_pool
        device = "cuda" if pool.is_cuda else "cpu"
        x = torch.full((HANDOFF_SIZE,), handoff_value(ctx.batch_index), dtype=torch.int64, device=device)
        if record_stream == "producer" and pool.is_cuda:
            for name in pool.names:
                if name != ctx.task.stream:
                    x.record_stream(pool.get(name))
        ctx.slots.set("x", x)

    def take(ctx) -> None:
        x = ctx.slots["x"]
        if ctx.stream_pool.is_cuda:
            cuda_spin(spin_ms)
            if record_stream == "consumer":
                x.record_stream(torch.cuda.current_stream())
        ctx.slots.set("step_result", x.clone())

    return TaskGraph.single_group(
        [
            Task.from_fn("take", take, reads=["x"], writes=["step_result"]),
            Task.from_fn("make", make, stream="side", lookahead=1, writes=["x"]),
        ],
        ("default", "side"),
    )
