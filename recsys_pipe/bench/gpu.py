"""GPU overlap benchmark: a plan shaped like recommendation training, serial and with lookaheads, side by
side, against the ideal bound of its streams.

The plan (one training iteration):

- h2d (lookahead 2, stream `memcpy`): the batch's pinned host tensors to the device
  (`non_blocking`), `record_stream`ed for the other streams that read them;
- comm (lookahead 1, stream `comm`): a stand-in for the input all-to-all: a spin kernel of
  `--comm-ms` and a device copy of the features (what an all-to-all would move);
- forward, backward, optimizer (lookahead 0, default stream): an MLP (`--layers` x `--width`) on
  the copied features, MSE loss, SGD with momentum; optimizer writes the loss as `step_result`.

Measured side by side, every repetition running each configuration once in a rotated order
(figures: medians over repetitions, with min-max):

- serial: the same five tasks at lookahead 0 on the default stream, sequential executor;
- with lookaheads, on the sequential and on the threaded executor (one CPU thread per stream);
- ideal: per iteration, the largest summed busy time of one stream, from CUDA events recorded on
  each task's stream around its work (after the engine's waits); no ordering of the work on these streams
  can beat it, and a plan with lookaheads that overlaps perfectly reaches it;
- host overhead per task, launch-bound: a 10-task chain over 3 streams and 3 lookaheads, each
  task one tiny kernel: engine time minus a plain loop launching the same kernels, per task.

Targets (GPU): with lookaheads <= 1.05 x ideal; and >= 1.3 x faster than serial where the
off-default work (h2d + comm) is >= 30 % of the serial iteration; host overhead <= 10 µs per
task sequential, <= 20 µs threaded. Check: every configuration trains bitwise the same losses
as serial (same seed, same batches); a mismatch exits 1.

`--device cpu` runs the same plan on CPU tensors with no-op streams (comm sleeps on its thread,
busy times are host times): a smoke test of the plan, not a measurement; no targets there.
The table goes to stdout; the last line is one JSON object with every figure.

    recsys-bench gpu [--quick] [--device cuda|cpu] [--repeats R] [--steps N] ...
    python -m recsys_pipe.bench.gpu ...    # the same, without the console script
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from recsys_pipe.bench.common import format_summary as fmt
from recsys_pipe.bench.common import summary
from recsys_pipe.bench.engine import chain_task_graph
from recsys_pipe.engine import (
    BATCH_CPU,
    STEP_RESULT,
    PlanRunner,
    StreamPool,
    Task,
    TaskGraph,
    TaskObserver,
    ThreadedExecutor,
)
from recsys_pipe.engine.testing import cuda_spin

STREAMS = ("default", "memcpy", "comm")
OFF_DEFAULT_TASKS = ("h2d", "comm")
TARGETS = {
    "lookahead_vs_ideal": 1.05,
    "speedup_vs_serial": 1.3,
    "speedup_applies_from_off_default_share": 0.30,
    "overhead_us_per_task_sequential": 10.0,
    "overhead_us_per_task_threaded": 20.0,
}
CONFIGS = ("serial", "lookahead_sequential", "lookahead_threaded")


@dataclass(frozen=True)
class Shape:
    """What one iteration does: batch rows x feature columns copied in, an MLP of `layers` linear
    layers of `width` (the last one to 1 output), a communication spin of `comm_ms`."""

    batch: int
    features: int
    width: int
    layers: int
    comm_ms: float
    dtype: str


SHAPES = {
    "cuda": Shape(batch=16384, features=1024, width=2048, layers=4, comm_ms=2.0, dtype="bfloat16"),
    "quick": Shape(batch=256, features=64, width=128, layers=2, comm_ms=0.5, dtype="float32"),
}


# -- the plan ---------------------------------------------------------------------------------------


@dataclass
class BenchState:
    """What every task sees as `ctx.state`."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    comm_ms: float


def record_for_other_streams(ctx: Any, *tensors: torch.Tensor) -> None:
    """The caching-allocator rule for memory read on other streams than the allocating one."""
    pool = ctx.stream_pool
    if pool.is_cuda:
        for name in pool.names:
            if name != ctx.task.stream:
                for tensor in tensors:
                    tensor.record_stream(pool.get(name))


def h2d(ctx: Any) -> None:
    """Copy the batch's pinned host tensors to the device, recorded for the streams that read them."""
    features, targets = ctx.slots[BATCH_CPU]
    device = ctx.state.device
    batch = (features.to(device, non_blocking=True), targets.to(device, non_blocking=True))
    record_for_other_streams(ctx, *batch)
    ctx.slots.set("batch", batch)


def comm(ctx: Any) -> None:
    """The stand-in for the input all-to-all: a `comm_ms` spin (a sleep on the CPU) and a device copy."""
    features, _ = ctx.slots["batch"]
    if ctx.state.device.type == "cuda":
        cuda_spin(ctx.state.comm_ms)
    else:
        time.sleep(ctx.state.comm_ms / 1e3)
    exchanged = features.clone()
    record_for_other_streams(ctx, exchanged)
    ctx.slots.set("exchanged", exchanged)


def forward(ctx: Any) -> None:
    """The MLP on the exchanged features and the MSE loss."""
    _, targets = ctx.slots["batch"]
    prediction = ctx.state.model(ctx.slots["exchanged"])
    ctx.slots.set("loss", nn.functional.mse_loss(prediction.float(), targets))


def backward(ctx: Any) -> None:
    """Backward of the loss."""
    ctx.slots["loss"].backward()


def optimizer_step(ctx: Any) -> None:
    """SGD step, gradients reset; the detached loss is the step's result."""
    ctx.state.optimizer.step()
    ctx.state.optimizer.zero_grad(set_to_none=True)
    ctx.slots.set(STEP_RESULT, ctx.slots["loss"].detach())


def training_plan(lookaheads: bool) -> TaskGraph:
    """The five tasks; `lookaheads=False` is the serial plan (lookahead 0, default stream)."""

    def placed(stream: str, lookahead: int) -> dict[str, Any]:
        return {"stream": stream, "lookahead": lookahead} if lookaheads else {}

    return TaskGraph.single_group(
        [
            Task.from_fn("h2d", h2d, reads=[BATCH_CPU], writes=["batch"], **placed("memcpy", 2)),
            Task.from_fn("comm", comm, reads=["batch"], writes=["exchanged"], **placed("comm", 1)),
            Task.from_fn("forward", forward, reads=["exchanged", "batch"], writes=["loss"]),
            Task.from_fn("backward", backward, reads=["loss"]),
            Task.from_fn("optimizer", optimizer_step, reads=["loss"], writes=[STEP_RESULT], depends_on=["backward"]),
        ],
        STREAMS,
    )


def make_state(shape: Shape, device: torch.device, seed: int = 0) -> BenchState:
    """A seeded MLP of `shape` with its SGD optimizer on `device`."""
    torch.manual_seed(seed)
    dims = [shape.features] + [shape.width] * (shape.layers - 1)
    layers: list[nn.Module] = []
    for d_in, d_out in zip(dims, dims[1:]):
        layers += [nn.Linear(d_in, d_out), nn.ReLU()]
    layers.append(nn.Linear(dims[-1], 1))
    model = nn.Sequential(*layers).to(device=device, dtype=getattr(torch, shape.dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)
    return BenchState(model, optimizer, device, shape.comm_ms)


def host_batches(shape: Shape, device: torch.device, count: int = 3, seed: int = 1) -> list[tuple]:
    """A few host batches, pinned when the device is CUDA (so copies are asynchronous); the
    benchmark cycles through them."""
    generator = torch.Generator().manual_seed(seed)
    pin = device.type == "cuda"
    batches = []
    for _ in range(count):
        features = torch.randn(shape.batch, shape.features, generator=generator).to(getattr(torch, shape.dtype))
        targets = torch.randn(shape.batch, 1, generator=generator)
        batches.append((features.pin_memory(), targets.pin_memory()) if pin else (features, targets))
    return batches


def executor_of(config: str) -> Any:
    """The executor of a configuration: one thread per stream for `lookahead_threaded`."""
    return ThreadedExecutor("by_stream") if config == "lookahead_threaded" else "sequential"


# -- measuring --------------------------------------------------------------------------------------


class BusyTimes(TaskObserver):
    """Busy time of each task invocation on its stream.

    On CUDA: events recorded on the task's stream just before and after its work (the hooks run
    inside its stream scope, after the engine's waits, so waiting is not counted); on CPU: host
    time around the task.
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._open: dict[str, Any] = {}  # a task never overlaps itself: its name keys it
        self._spans: list[tuple[str, str, Any, Any]] = []
        self._lock = threading.Lock()

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def task_started(self, task: Task, batch_index: int, iteration: int) -> None:
        mark = self._mark()
        with self._lock:
            self._open[task.name] = mark

    def task_finished(self, task: Task, batch_index: int, iteration: int, failed: bool) -> None:
        end = self._mark()
        with self._lock:
            self._spans.append((task.name, task.stream, self._open.pop(task.name), end))

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def seconds(self) -> list[tuple[str, str, float]]:
        """(task, stream, busy seconds) of every invocation since `clear()` (synchronizes)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [(t, s, start.elapsed_time(end) / 1e3) for t, s, start, end in self._spans]
        return [(t, s, end - start) for t, s, start, end in self._spans]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_plan(config: str, shape: Shape, device: torch.device, batches: list, steps: int, warmup: int) -> dict:
    """One configuration, one repetition: steady-state iteration time and busy time per stream and
    task, per iteration, in seconds."""
    state = make_state(shape, device)
    pool = StreamPool.create(STREAMS, device)
    busy = BusyTimes(cuda=device.type == "cuda")
    plan = training_plan(lookaheads=config != "serial")
    with PlanRunner(plan, pool, executor_of(config), state=state, observer=busy) as runner:
        it = itertools.cycle(batches)
        for _ in range(warmup):
            runner.progress(it)
        synchronize(device)
        busy.clear()
        start = time.perf_counter()
        for _ in range(steps):  # in steady state each progress() is one internal iteration
            runner.progress(it)
        synchronize(device)
        elapsed = time.perf_counter() - start
        spans = busy.seconds()
    per_stream: dict[str, float] = {}
    per_task: dict[str, float] = {}
    for task, stream, seconds in spans:
        per_stream[stream] = per_stream.get(stream, 0.0) + seconds / steps
        per_task[task] = per_task.get(task, 0.0) + seconds / steps
    return {
        "iteration_s": elapsed / steps,
        "ideal_s": max(per_stream.values()),
        "busy_s": per_stream,
        "task_s": per_task,
    }


def losses(config: str, shape: Shape, device: torch.device, batches: list, steps: int) -> torch.Tensor:
    """The first `steps` losses of a fresh model (same seed) on the same batches."""
    state = make_state(shape, device)
    pool = StreamPool.create(STREAMS, device)
    with PlanRunner(training_plan(config != "serial"), pool, executor_of(config), state=state) as runner:
        it = itertools.cycle(batches)
        result = torch.stack([runner.progress(it) for _ in range(steps)])
    synchronize(device)
    return result.cpu()


def launch_bound_chain(num_tasks: int, device: torch.device) -> TaskGraph:
    """`num_tasks` tasks in a chain over three lookaheads and three streams (one per lookahead),
    each launching one tiny kernel on its own one-element tensor."""
    tensors = {f"t{i}": torch.zeros(1, device=device) for i in range(num_tasks)}

    def tiny(ctx: Any) -> None:
        tensors[ctx.task.name].add_(1)

    return chain_task_graph(num_tasks, tiny, ("memcpy", "comm", "default"), STREAMS)


def overhead_us_per_task(executor: Any, device: torch.device, iterations: int, num_tasks: int = 10) -> float:
    """Engine time minus a plain loop launching the same kernels (same order, one stream), per task."""
    task_graph = launch_bound_chain(num_tasks, device)
    pool = StreamPool.create(STREAMS, device)
    with PlanRunner(task_graph, pool, executor) as runner:
        it = itertools.repeat(None)
        for _ in range(50):
            runner.progress(it)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(iterations):
            runner.progress(it)
        synchronize(device)
        engine = time.perf_counter() - start
        calls = [(task.fn, _PlainContext(task)) for task in runner.graph.order]
    start = time.perf_counter()
    for _ in range(iterations):
        for fn, ctx in calls:
            fn(ctx)
    synchronize(device)
    plain = time.perf_counter() - start
    return (engine - plain) / (iterations * num_tasks) * 1e6


class _PlainContext:
    """The one field the tiny tasks read, for calling them outside the engine."""

    __slots__ = ("task",)

    def __init__(self, task: Task):
        self.task = task


# -- driver -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the shape and counts filled in from the device's defaults; bad values exit 2."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="smoke test: a tiny shape, few steps, 2 repetitions")
    parser.add_argument("--repeats", type=int, help="interleaved repetitions (default 5; quick: 2)")
    parser.add_argument("--steps", type=int, help="timed iterations per run (default 100; quick: 8)")
    parser.add_argument("--warmup", type=int, help="iterations before timing (default 20; quick: 3)")
    parser.add_argument("--overhead-iterations", type=int, help="iterations of the launch-bound chain (default 2000)")
    for field in ("batch", "features", "width", "layers"):
        parser.add_argument(f"--{field}", type=int, help=f"shape: {field} (default: {SHAPES['cuda'].__dict__[field]})")
    parser.add_argument(
        "--comm-ms", type=float, help=f"communication spin per iteration (default {SHAPES['cuda'].comm_ms})"
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="model and feature dtype")
    args = parser.parse_args(argv)
    quick = args.quick or args.device == "cpu"  # the full shape is a GPU workload
    base = SHAPES["quick" if quick else "cuda"]
    overrides = {f: getattr(args, f) for f in ("batch", "features", "width", "layers", "comm_ms", "dtype")}
    args.shape = Shape(**{**asdict(base), **{k: v for k, v in overrides.items() if v is not None}})
    defaults = {"repeats": (5, 2), "steps": (100, 8), "warmup": (20, 3), "overhead_iterations": (2000, 100)}
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    for name in ("repeats", "steps", "warmup", "overhead_iterations", "batch", "features", "width", "layers"):
        value = getattr(args, name) if name in defaults else getattr(args.shape, name)
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.shape.comm_ms < 0:
        parser.error(f"--comm-ms must be >= 0, got {args.shape.comm_ms}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark.

    Returns:
        The exit status: 0, 1 when a configuration trained other losses than serial, 2 without CUDA.
    """
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("bench_gpu: no CUDA device is visible; use --device cpu for the CPU smoke test", file=sys.stderr)
            return 2
        cuda_spin(0.01)  # calibrate the spin kernel before anything is timed
    shape = args.shape
    batches = host_batches(shape, device)

    runs: dict[str, Callable[[], Any]] = {
        config: (lambda c=config: measure_plan(c, shape, device, batches, args.steps, args.warmup))
        for config in CONFIGS
    }
    runs["overhead_sequential"] = lambda: overhead_us_per_task("sequential", device, args.overhead_iterations)
    runs["overhead_threaded"] = lambda: overhead_us_per_task(
        ThreadedExecutor("by_stream"), device, args.overhead_iterations
    )
    names = list(runs)
    samples: dict[str, list] = {name: [] for name in names}
    for r in range(args.repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(runs[name]())

    reference = losses("serial", shape, device, batches, 6)
    same_losses = {c: bool(torch.equal(losses(c, shape, device, batches, 6), reference)) for c in CONFIGS[1:]}

    report = build_report(args, device, samples, same_losses)
    print_table(report)
    print(json.dumps(report))
    return 0 if all(same_losses.values()) else 1


def build_report(args: argparse.Namespace, device: torch.device, samples: dict[str, list], same: dict) -> dict:
    """The report: per configuration, medians (min-max) of the iteration, ideal and busy times and ratios."""
    ms = 1e3
    configs: dict[str, Any] = {}
    for config in CONFIGS:
        runs = samples[config]
        entry = {
            "iteration_ms": summary(r["iteration_s"] * ms for r in runs),
            "ideal_ms": summary(r["ideal_s"] * ms for r in runs),
            "busy_ms": {s: summary(r["busy_s"].get(s, 0.0) * ms for r in runs) for s in STREAMS},
            "task_ms": {t: summary(r["task_s"][t] * ms for r in runs) for t in runs[0]["task_s"]},
        }
        if config != "serial":
            entry["ratio_vs_ideal"] = summary(r["iteration_s"] / r["ideal_s"] for r in runs)
            entry["speedup_vs_serial"] = summary(
                s["iteration_s"] / r["iteration_s"] for s, r in zip(samples["serial"], runs)
            )
        configs[config] = entry
    share = summary(sum(r["task_s"][t] for t in OFF_DEFAULT_TASKS) / r["iteration_s"] for r in samples["serial"])
    overhead = {kind: summary(samples[f"overhead_{kind}"], 2) for kind in ("sequential", "threaded")}
    report: dict[str, Any] = {
        "machine": machine(args, device),
        "configs": configs,
        "off_default_share_of_serial": share,
        "overhead_us_per_task": overhead,
        "numerics": {"losses_bitwise_equal_to_serial": same},
    }
    report["targets"] = targets(report, device)
    return report


def machine(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The device, versions, counts and shape the report was measured with."""
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "repeats": args.repeats,
        "steps": args.steps,
        "warmup": args.warmup,
        "overhead_iterations": args.overhead_iterations,
        "shape": asdict(args.shape),
    }
    return info


def targets(report: dict, device: torch.device) -> dict[str, Any]:
    """Which GPU targets the report meets (not evaluated on the CPU)."""
    if device.type != "cuda":
        return {"limits": TARGETS, "evaluated": False, "reason": "the targets are for a GPU; this was a CPU run"}
    with_lookaheads = [report["configs"][c] for c in CONFIGS[1:]]
    share = report["off_default_share_of_serial"]["median"]
    met: dict[str, Any] = {
        "lookahead_vs_ideal": all(
            p["ratio_vs_ideal"]["median"] <= TARGETS["lookahead_vs_ideal"] for p in with_lookaheads
        ),
        "speedup_vs_serial": (
            all(p["speedup_vs_serial"]["median"] >= TARGETS["speedup_vs_serial"] for p in with_lookaheads)
            if share >= TARGETS["speedup_applies_from_off_default_share"]
            else "not applicable: off-default work below 30 % of the serial iteration"
        ),
        "overhead_us_per_task_sequential": report["overhead_us_per_task"]["sequential"]["median"]
        <= TARGETS["overhead_us_per_task_sequential"],
        "overhead_us_per_task_threaded": report["overhead_us_per_task"]["threaded"]["median"]
        <= TARGETS["overhead_us_per_task_threaded"],
        "losses_bitwise_equal_to_serial": all(report["numerics"]["losses_bitwise_equal_to_serial"].values()),
    }
    return {"limits": TARGETS, "evaluated": True, "met": met}


def print_table(report: dict) -> None:
    """Print the report as a table."""
    m = report["machine"]
    print(
        f"GPU overlap benchmark on {m['device']} (torch {m['torch']}, CUDA {m['cuda']}): "
        f"medians (min–max) over {m['repeats']} interleaved repetitions of {m['steps']} iterations"
    )
    print(f"shape: {m['shape']}")
    print(f"{'configuration':<24} {'iteration ms':<24} {'ideal ms':<24} {'÷ ideal':<22} {'speedup vs serial':<22}")
    for name, c in report["configs"].items():
        ratio = fmt(c["ratio_vs_ideal"]) if "ratio_vs_ideal" in c else "–"
        speedup = fmt(c["speedup_vs_serial"]) if "speedup_vs_serial" in c else "–"
        print(f"{name:<24} {fmt(c['iteration_ms']):<24} {fmt(c['ideal_ms']):<24} {ratio:<22} {speedup:<22}")
    for name, c in report["configs"].items():
        busy = ", ".join(f"{s} {v['median']}" for s, v in c["busy_ms"].items())
        print(f"  busy ms per stream, {name}: {busy}")
    print(f"off-default work (h2d + comm) / serial iteration: {fmt(report['off_default_share_of_serial'])}")
    o = report["overhead_us_per_task"]
    print(f"host overhead, launch-bound, µs/task: sequential {fmt(o['sequential'])}, threaded {fmt(o['threaded'])}")
    same = report["numerics"]["losses_bitwise_equal_to_serial"]
    print("losses bitwise equal to serial: " + ", ".join(f"{c}={'yes' if v else 'NO'}" for c, v in same.items()))
    t = report["targets"]
    if t["evaluated"]:
        print("targets met: " + ", ".join(f"{k}={_yes(v)}" for k, v in t["met"].items()))
    else:
        print(f"targets not evaluated: {t['reason']}")


def _yes(value: Any) -> str:
    return value if isinstance(value, str) else ("yes" if value else "NO")


if __name__ == "__main__":
    sys.exit(main())
