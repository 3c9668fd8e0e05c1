"""The training performance record: the shipped plans against torchrec's own pipelines.

Every variant trains the same model (same seed) on the same pre-built batches (data loading is
not timed), side by side in one process group:

  serial                       pipeline=serial (sequential executor)
  sparse_dist                  pipeline=sparse_dist (torchrec's layout, sequential executor)
  hstu_sparse_dist/sequential  pipeline=hstu_sparse_dist pipeline.executor=sequential
  hstu_sparse_dist/threaded    pipeline=hstu_sparse_dist (threaded, thread_map=hstu_default)
  hstu_prefetch/sequential     pipeline=hstu_prefetch pipeline.executor=sequential
  hstu_prefetch/threaded       pipeline=hstu_prefetch (threaded, thread_map=hstu_default)
  sparse_dist/inplace_copy     sparse_dist with pipeline.tasks.h2d.options.inplace_copy=true
  torchrec_sdd                 torchrec's TrainPipelineSparseDist (custom_model_fwd)
  torchrec_prefetch            torchrec's PrefetchTrainPipelineSparseDist (CUDA only: on the
                               CPU it fails, its caching kernels are CUDA-only)

`--variants` also takes every plan file by its name (conf/pipeline/<name>.yaml: base,
sparse_dist_lite, sparse_dist_enqueue_after_forward, prefetch, fused_sparse_dist, semi_sync,
...) and every torchrec class of the family (`TORCHREC_CLASSES`): torchrec_base,
torchrec_lite, torchrec_sdd_enqueue_after_forward, torchrec_sdd_inplace_copy, and on CUDA torchrec_fused and
torchrec_semi_sync (on the CPU torchrec 1.8 fails in `Tensor.record_stream`: "unknown parameter
type"). A plan with a torchrec counterpart (`COUNTERPART`) also gets "vs class", the paired
ratio to that class. The semi_sync plan and class train other numbers (stale embeddings): their
losses are checked against each other, not against serial's.

The plans run exactly as `recsys-train` runs them: `training_plan(run)` compiles the plan,
`Trainer(build_parts(run, plan, info)).fit()` trains (bootstrap, per-step bookkeeping and all); only the
progress bar, evaluation and the metrics all-reduce are off (`trainer.log_every` past the run),
since torchrec's loop here does none of them.

Method. For each batch size of the sweep, every repetition runs every variant once, in an
order rotated per repetition, so a slow spell of the shared machine hits all variants alike.
A run is: a fresh model, `warmup` untimed steps, a barrier, `steps` timed steps, then `TAIL`
untimed steps (the window never includes the drain). Figures are medians over repetitions with
(min-max); "vs torchrec" is the median of the per-repetition ratios to `torchrec_sdd` (same
repetition, so a slow spell cancels out). Per-step losses of every variant and repetition are
asserted bitwise equal on the CPU (the numerics are the same there); on CUDA they are reported,
not asserted. A repetition during which other jobs used more than `--max-other-load` of the
machine's cores (its CPU use from /proc/stat minus this benchmark's) is discarded and run again
(after a pause, at most `--retries` times per batch size; the report counts them). On the CPU each rank is
pinned to its own core (`--no-pin` to keep the OS's placement): with two ranks on two shared
cores the scheduler otherwise moves ranks and their gloo threads around, which spread the
per-repetition ratios about twice as wide in our runs.

The speed gate. A plan with a torchrec counterpart must reach `--min-vs-class` (0.95) of that
class's speed: the median of the paired per-repetition ratios ("vs class"), per batch size. It
is judged only in a clean window: every kept repetition of the plan and of its class with other
jobs at or below `--max-other-load`. A clean pair below the limit fails the run (exit 1, the plan,
class, batch size and ratio on stderr, after the report); a pair whose window was not clean is
named as not judged, and does not fail it. `--quick` turns the gate off (3 timed steps measure
no speed). The report's "speed_gate" holds every verdict.

What a column means (per rank; the larger of the ranks):

- ms/step: wall time of the window / steps; samples/s = batch * ranks / (ms/step).
- CPU ms/step: CPU time of the whole process (every thread: the executor's, gloo's) over the
  window / steps. Two ranks on two cores with CPU ms/step close to ms/step leave no core to
  overlap with.
- engine µs/step (and its share of ms/step): measured with a `TaskObserver` on the plan runner.
  Per timed iteration, from `iteration_started` to `tasks_done`, the time during which no task
  body (`task.run`, between `task_started` and `task_finished`) ran on any thread: dispatch,
  dependency latches, thread hand-offs and wake-ups, the batch pull, the executor's join. Time
  a thread waits while a task runs on another thread is the task's, not the engine's (for the
  sequential executor this is the iteration minus the sum of its task bodies; for the threaded
  one, the gaps in the union of all threads' task spans). The observer's own hooks fall in the
  gaps, so the figure includes them (`observer µs/step` states their cost, timed alone).
- release µs/step: `tasks_done` to `iteration_finished`: rotating the ring drops the trained
  batch's values (batch, torchrec context, outputs and their autograd graph). Any loop pays
  this when it lets go of a batch (torchrec's when it dequeues), so it is not engine overhead.
- loop µs/step: time between iterations: `Trainer.fit`'s per-step bookkeeping and the call
  into `progress()`.
- GC ms/step: Python's cyclic garbage collections in the window (`gc.callbacks`); collections
  outside task bodies are left out of the engine, release and loop figures.
- peak RSS per rank (MiB): the process's resident-set high-water mark (VmHWM) during the run,
  model build to teardown. Between runs the previous run's garbage is collected and returned
  to the OS (`malloc_trim`), then the mark is reset to the current RSS by writing "5" to
  /proc/self/clear_refs; "growth" is the peak minus the RSS at that reset (the run's own model,
  optimizer state, in-flight batches and activations). Resetting in-process keeps the
  interleaving in one process group; a fresh process per run would add a torchrun start per
  run and measure the same thing (checked: README). On CUDA also the peak allocated and
  reserved device memory (`torch.cuda.max_memory_allocated/reserved`, reset per run).

`--host`: what the host does per step, task by task (`recsys_pipe.bench.host_ops`): after the
timed repetitions, one more run of every plan counts, over `--host-steps` steps of the window,
the aten operators each task dispatches, those that launch a kernel on a GPU, and the host syncs
with their call sites; on CUDA also the GPU's busy time per step (torch.profiler's kernels and
copies) and the syncs CUDA itself reports (`torch.cuda.set_sync_debug_mode`). With the timed
window's ms/step and CPU ms/step this says whether the step is host-bound: CPU ms per step
above GPU ms per step. Before / after a change, side by side:
`recsys-bench compare --baseline main train --host --batch-sizes 32 --variants serial`.

Run (2 ranks; without torchrun the module re-executes itself under it). Hold the shared CPU
lock and bound it:

    flock /tmp/recsys_cpu.lock timeout 3000 recsys-bench train
    recsys-bench train --batch-sizes 32 --repeats 7 --steps 40
    recsys-bench train --plan 'late=pipeline=sparse_dist pipeline.tasks.h2d.lookahead=3'
    recsys-bench train --quick     # CI smoke: tiny, every variant once
    python -m recsys_pipe.bench.train --quick   # the same, without the console script

Rank 0 prints progress, a table per batch size, the targets, the speed gate and, last, one JSON
line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from recsys_pipe.bench.common import one_thread_per_rank, reexec_under_torchrun, run_ranks, summary
from recsys_pipe.bench.timing import TAIL, PeakMemory, StepTimer, Window, observer_cost_us

NPROC = 2

#: the engine variants: name -> overrides on top of `common_overrides`
PLANS: dict[str, tuple[str, ...]] = {
    "serial": ("pipeline=serial",),
    "sparse_dist": ("pipeline=sparse_dist",),
    "hstu_sparse_dist/sequential": ("pipeline=hstu_sparse_dist", "pipeline.executor=sequential"),
    "hstu_sparse_dist/threaded": ("pipeline=hstu_sparse_dist", "pipeline.executor=threaded"),
    "hstu_prefetch/sequential": ("pipeline=hstu_prefetch", "pipeline.executor=sequential"),
    "hstu_prefetch/threaded": ("pipeline=hstu_prefetch", "pipeline.executor=threaded"),
    "sparse_dist/inplace_copy": ("pipeline=sparse_dist", "pipeline.tasks.h2d.options.inplace_copy=true"),
}
TORCHREC = "torchrec_sdd"
TORCHREC_PREFETCH = "torchrec_prefetch"
#: torchrec's classes: variant -> (class in torchrec.distributed.train_pipeline.train_pipelines,
#: constructor options, runs on the CPU)
TORCHREC_CLASSES: dict[str, tuple[str, dict[str, Any], bool]] = {
    TORCHREC: ("TrainPipelineSparseDist", {}, True),
    "torchrec_base": ("TrainPipelineBase", {}, True),
    "torchrec_lite": ("TrainPipelineSparseDistLite", {}, True),
    "torchrec_sdd_enqueue_after_forward": ("TrainPipelineSparseDist", {"enqueue_batch_after_forward": True}, True),
    "torchrec_sdd_inplace_copy": ("TrainPipelineSparseDist", {"enable_inplace_copy_batch": True}, True),
    TORCHREC_PREFETCH: ("PrefetchTrainPipelineSparseDist", {}, False),
    "torchrec_fused": ("TrainPipelineFusedSparseDist", {}, False),
    "torchrec_semi_sync": ("TrainPipelineSemiSync", {"start_batch": 0, "stash_gradients": False}, False),
}
#: plan file -> the torchrec class variant whose order of work it declares
COUNTERPART = {
    "sparse_dist": TORCHREC,
    "base": "torchrec_base",
    "sparse_dist_lite": "torchrec_lite",
    "sparse_dist_enqueue_after_forward": "torchrec_sdd_enqueue_after_forward",
    "sparse_dist/inplace_copy": "torchrec_sdd_inplace_copy",
    "prefetch": TORCHREC_PREFETCH,
    "fused_sparse_dist": "torchrec_fused",
    "semi_sync": "torchrec_semi_sync",
}
#: variants that train other numbers than serial (stale embeddings; also a stale dense update):
#: variant -> its group, whose members' losses are compared with each other
STALE = {"semi_sync": "semi_sync", "torchrec_semi_sync": "semi_sync", "semi_sync_stash": "semi_sync_stash"}
BATCH_SIZES = (32, 256, 1024)
#: timed and warm-up steps per batch size (about 0.7-1.5 s of timed steps per run on 2 CPU cores)
STEPS = {32: 64, 256: 24, 1024: 8}
WARMUP = {32: 6, 256: 4, 1024: 3}
TARGET_SPEED = 1.0  # every plan with lookaheads >= 1.0x torchrec_sdd (median, CPU, batch 32 and 256)
TARGET_SPEED_BATCHES = (32, 256)
TARGET_RSS = 1.05  # peak RSS <= 1.05x torchrec_sdd's
TARGET_ENGINE_SHARE = 0.5  # percent of a step
#: the speed gate: every plan >= this fraction of its torchrec class (`COUNTERPART`), in a clean window
MIN_VS_CLASS = 0.95


# -- variants -------------------------------------------------------------------------------------


def common_overrides(device: torch.device, batch_size: int, num_batches: int) -> list[str]:
    """The overrides every variant shares: no progress bar, evaluation or metrics all-reduce; the batches."""
    return [
        "trainer.progress_bar=false",
        "trainer.eval_every=0",
        "trainer.eval_batches=0",
        "trainer.max_steps=null",
        f"trainer.device={device.type}",
        f"trainer.backend={'nccl' if device.type == 'cuda' else 'gloo'}",
        f"trainer.log_every={num_batches + 1}",  # no metrics all-reduce: torchrec's loop has none
        f"data.batch_size={batch_size}",
        f"data.num_batches={num_batches}",
    ]


class Bench:
    """The runs of one batch size: configs, batches, and one run of any variant."""

    def __init__(self, info: Any, batch_size: int, warmup: int, steps: int, plans: dict[str, tuple[str, ...]]):
        from recsys_pipe.data import make_dataloader
        from recsys_pipe.testing import load_run

        self.info, self.batch_size, self.warmup, self.steps = info, batch_size, warmup, steps
        self.cuda = info.device.type == "cuda"
        total = warmup + steps + TAIL
        common = common_overrides(info.device, batch_size, total)
        self.runs = {name: load_run(*common, *overrides) for name, overrides in plans.items()}
        self.runs.setdefault("serial", load_run(*common, *PLANS["serial"]))  # torchrec's model and data
        loader = make_dataloader(self.runs["serial"].data, info.rank, info.world_size)
        self.spec = loader.dataset.spec
        self.batches = list(loader)
        assert len(self.batches) == total, (len(self.batches), total)
        self.memory = PeakMemory(info.device)

    def run(self, name: str) -> dict[str, Any]:
        """One run of variant `name`: this rank's figures, losses and peak memory."""
        self.memory.start()
        window = Window(self.info.device)
        if name not in TORCHREC_CLASSES:
            losses, extra = self._train_plan(name, window)
        else:
            losses, extra = self._train_torchrec(name, window)
        memory = self.memory.stop()
        return {**window.figures(), **memory, **extra, "losses": losses}

    def _train_plan(self, name: str, window: Window) -> tuple[list[float], dict[str, Any]]:
        from recsys_pipe.train import Trainer, build_parts, training_plan

        run = self.runs[name]
        plan = training_plan(run)
        trainer = Trainer(build_parts(run, plan, self.info))
        try:
            first = self.warmup + plan.task_graph.max_lookahead  # iteration k + L completes step k
            timer = StepTimer(window, first, first + self.steps)
            trainer.plan_runner.observer = timer
            summary = trainer.fit(iter(self.batches), record_steps=not self.cuda)
            assert summary.steps == len(self.batches), (summary.steps, len(self.batches))
            losses = summary.losses if not self.cuda else [summary.first_loss, summary.last_loss]
            return losses, {"breakdown": timer.breakdown()}
        finally:
            trainer.close()

    def count_host(self, name: str, steps: int) -> dict[str, Any]:
        """One more run of plan `name` counting what the host does per task over `steps` steps of
        the window (`HostOps`); this rank's figures."""
        from recsys_pipe.bench.host_ops import HostOps
        from recsys_pipe.train import Trainer, build_parts, training_plan

        run = self.runs[name]
        plan = training_plan(run)
        trainer = Trainer(build_parts(run, plan, self.info))
        try:
            first = self.warmup + plan.task_graph.max_lookahead
            host = HostOps(first, first + steps, self.cuda)
            trainer.plan_runner.observer = host
            with host.counting():
                trainer.fit(iter(self.batches))
            return host.report(steps)
        finally:
            trainer.close()

    def _train_torchrec(self, name: str, window: Window) -> tuple[list[float], dict[str, Any]]:
        from recsys_pipe.testing import torchrec_pipeline
        from recsys_pipe.train import build_model

        model, optimizer = build_model(self.runs["serial"], self.info, self.spec)
        cls, options, _ = TORCHREC_CLASSES[name]
        pipe = torchrec_pipeline(model, optimizer, self.info.device, cls, **options)
        losses: list[Any] = []
        it = iter(self.batches)
        for step in range(len(self.batches)):
            if step == self.warmup:
                window.open()
            loss, _ = pipe.progress(it)
            if step == self.warmup + self.steps - 1:
                window.close()
            losses.append(loss if self.cuda else float(loss))  # CUDA: no host sync per step
        try:
            pipe.progress(it)
        except StopIteration:
            pass
        else:
            raise AssertionError(f"{name} trained more batches than it was given")
        if self.cuda:
            losses = [float(losses[0]), float(losses[-1])]
        return losses, {}


# -- reporting ------------------------------------------------------------------------------------


def other_load(runs: list[dict[str, Any]], cores: int) -> float:
    """Share of all cores other jobs used during one run's window: the machine's CPU use minus
    this benchmark's ranks' (the ranks' windows coincide: they open after a barrier)."""
    seconds = max(r["seconds"] for r in runs)
    ours = sum(r["cpu_seconds"] for r in runs) / (cores * seconds)
    return max(0.0, max(r["machine_busy"] for r in runs) - ours)


def fmt(s: dict[str, float] | None, digits: int = 0) -> str:
    """`median (min–max)` of a summary, or `-` for none."""
    if s is None:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def aggregate(
    records: dict[str, list[list[dict[str, Any]]]], batch_size: int, steps: int, world: int, cores: int
) -> dict[str, Any]:
    """Per variant, medians (min-max) over repetitions of the per-rank figures (the larger of
    the ranks per repetition), and the paired ratios to torchrec_sdd."""
    samples = batch_size * world * steps
    out: dict[str, Any] = {}
    for name, reps in records.items():

        def worst(key: str, reps: list = reps) -> list[float]:
            return [max(rank[key] for rank in rep) for rep in reps]

        seconds = worst("seconds")
        row: dict[str, Any] = {
            "samples_per_s": summary((samples / s for s in seconds), 1),
            "ms_per_step": summary((s / steps * 1e3 for s in seconds), 2),
            "cpu_ms_per_step": summary((c / steps * 1e3 for c in worst("cpu_seconds")), 2),
            "machine_busy_percent": summary((b * 100 for b in worst("machine_busy")), 1),
            # the whole machine's CPU use minus this benchmark's ranks': other jobs on the machine
            "other_load_percent": summary((other_load(rep, cores) * 100 for rep in reps), 1),
        }
        row["gc_ms_per_step"] = summary((max(sum(r["gc_seconds"]) for r in rep) / steps * 1e3 for rep in reps), 3)
        row["gc_collections_per_step_rank0"] = [
            round(statistics.median(rep[0]["gc_count"][g] for rep in reps) / steps, 3) for g in range(3)
        ]
        if reps[0][0]["peak_rss_mib"] is not None:
            row["peak_rss_mib"] = summary(worst("peak_rss_mib"), 1)
            row["rss_growth_mib"] = summary(worst("rss_growth_mib"), 1)
            row["peak_rss_mib_per_rank"] = [
                round(statistics.median(rep[r]["peak_rss_mib"] for rep in reps), 1) for r in range(world)
            ]
        if "cuda_peak_allocated_mib" in reps[0][0]:
            row["cuda_peak_allocated_mib"] = summary(worst("cuda_peak_allocated_mib"), 1)
            row["cuda_peak_reserved_mib"] = summary(worst("cuda_peak_reserved_mib"), 1)
        if "breakdown" in reps[0][0]:
            row.update(breakdown_row(reps, steps))
        out[name] = row
    add_ratios(records, out)
    return out


def breakdown_row(reps: list[list[dict[str, Any]]], steps: int) -> dict[str, Any]:
    """A variant's engine figures over its repetitions (where the engine's observer ran): its
    time per step and share of a step, and rank 0's time per task, per thread and by position."""
    out: dict[str, Any] = {}

    def per_step_us(key: str) -> list[float]:
        return [max(rank["breakdown"][key] for rank in rep) / steps * 1e6 for rep in reps]

    out["engine_us_per_step"] = summary(per_step_us("engine_s"), 1)
    out["engine_share_percent"] = summary(
        (
            max(rank["breakdown"]["engine_s"] / rank["seconds"] for rank in rep) * 100
            for rep in reps  # the larger share of the ranks
        ),
        3,
    )
    out["release_us_per_step"] = summary(per_step_us("release_s"), 1)
    out["loop_us_per_step"] = summary(per_step_us("loop_s"), 1)
    out["gc_outside_tasks_us_per_step"] = summary(per_step_us("gc_outside_tasks_s"), 1)
    out["task_busy_ms_per_step"] = summary((v / 1e3 for v in per_step_us("busy_s")), 2)
    rank0 = [rep[0]["breakdown"] for rep in reps]
    out["rank0_task_ms_per_step"] = {
        task: round(statistics.median(b["per_task_s"][task] for b in rank0) / steps * 1e3, 3)
        for task in rank0[0]["per_task_s"]
    }
    out["rank0_thread_ms_per_step"] = {
        thread: round(statistics.median(b["per_thread_s"].get(thread, 0.0) for b in rank0) / steps * 1e3, 3)
        for thread in rank0[0]["per_thread_s"]
    }
    out["thread_of"] = rank0[0]["thread_of"]
    out["rank0_engine_us_per_step_by_position"] = {
        where: round(statistics.median(b["gaps_s"].get(where, 0.0) for b in rank0) / steps * 1e6, 1)
        for where in rank0[0]["gaps_s"]
    }
    return out


def add_ratios(records: dict[str, list[list[dict[str, Any]]]], out: dict[str, Any]) -> None:
    """Add to each variant's row of `out` its paired speed ratios (and memory ratios) to its
    torchrec class and to torchrec_sdd, repetition by repetition."""
    for name, counterpart in COUNTERPART.items():
        if name in records and counterpart in records:
            reference = [max(rank["seconds"] for rank in rep) for rep in records[counterpart]]
            mine = [max(rank["seconds"] for rank in rep) for rep in records[name]]
            out[name]["vs_counterpart"] = {
                "variant": counterpart,
                **summary((r / s for r, s in zip(reference, mine)), 3),
            }
    if TORCHREC in records:
        reference = [max(rank["seconds"] for rank in rep) for rep in records[TORCHREC]]
        for name, reps in records.items():
            mine = [max(rank["seconds"] for rank in rep) for rep in reps]
            out[name]["vs_torchrec"] = summary((ref / s for ref, s in zip(reference, mine)), 3)
            if "peak_rss_mib" in out[name]:
                out[name]["rss_vs_torchrec"] = round(
                    out[name]["peak_rss_mib"]["median"] / out[TORCHREC]["peak_rss_mib"]["median"], 3
                )
                out[name]["rss_growth_vs_torchrec"] = round(
                    out[name]["rss_growth_mib"]["median"] / out[TORCHREC]["rss_growth_mib"]["median"], 3
                )


def print_table(batch_size: int, steps: int, repeats: int, world: int, rows: dict[str, Any]) -> None:
    """Print one batch size's table of every variant."""
    print(
        f"\nbatch {batch_size}/rank x {world} ranks, {steps} timed steps, medians (min–max) over {repeats} "
        "interleaved repetitions; per rank, the larger of the ranks"
    )
    header = (
        f"{'variant':<36} {'samples/s':>20} {'ms/step':>8} {'CPU ms/step':>11} {'vs torchrec':>21} {'vs class':>21} "
        f"{'engine µs/step':>18} {'share %':>7} {'release µs':>10} {'loop µs':>8} {'GC ms':>6} {'peak RSS MiB':>12} "
        f"{'growth MiB':>10}"
    )
    print(header)
    for name, r in rows.items():
        engine = fmt(r.get("engine_us_per_step"))
        share = f"{r['engine_share_percent']['median']:.2f}" if "engine_share_percent" in r else "-"
        release = f"{r['release_us_per_step']['median']:.0f}" if "release_us_per_step" in r else "-"
        loop = f"{r['loop_us_per_step']['median']:.0f}" if "loop_us_per_step" in r else "-"
        rss = f"{r['peak_rss_mib']['median']:.0f}" if "peak_rss_mib" in r else "-"
        growth = f"{r['rss_growth_mib']['median']:.0f}" if "rss_growth_mib" in r else "-"
        vs = fmt(r.get("vs_torchrec"), 3)
        vs_class = fmt(r.get("vs_counterpart"), 3)
        print(
            f"{name:<36} {fmt(r['samples_per_s']):>20} {r['ms_per_step']['median']:>8.2f} "
            f"{r['cpu_ms_per_step']['median']:>11.2f} {vs:>21} {vs_class:>21} {engine:>18} {share:>7} {release:>10} "
            f"{loop:>8} "
            f"{r['gc_ms_per_step']['median']:>6.2f} {rss:>12} {growth:>10}"
        )
        if "cuda_peak_allocated_mib" in r:
            print(
                f"{'':<36} CUDA peak allocated {fmt(r['cuda_peak_allocated_mib'])} MiB, "
                f"reserved {fmt(r['cuda_peak_reserved_mib'])} MiB"
            )
    busy = statistics.median(r["machine_busy_percent"]["median"] for r in rows.values())
    other = max(r["other_load_percent"]["max"] for r in rows.values())
    print(
        f"machine CPU busy during the windows (all cores, median): {busy:.0f} %; "
        f"other jobs' share of the cores, at most: {other:.0f} %"
    )


def print_host(rows: dict[str, Any]) -> None:
    """Print rank 0's host work per step (`--host`): operators, launches, syncs, by task."""
    print("rank 0 host work per step (--host): aten operators / of them launching a kernel / host syncs")
    for name, r in rows.items():
        host = r.get("host")
        if host is None:
            continue
        device = ""
        if "gpu_ms_per_step" in host:
            device = (
                f"; GPU busy {host['gpu_ms_per_step']:.3f} ms/step against CPU {r['cpu_ms_per_step']['median']:.2f}, "
                f"CUDA-reported syncs {host['cuda_sync_warnings_per_step']}/step"
            )
        print(
            f"  {name:<36} {host['ops_per_step']:.0f} / {host['launches_per_step']:.0f} / "
            f"{host['syncs_per_step']:.1f}{device}"
        )
        print(
            "    by task: "
            + ", ".join(f"{t} {v['ops']:.0f}/{v['launches']:.0f}/{v['syncs']:.1f}" for t, v in host["by_task"].items())
        )
        for site, n in host["sync_sites"].items():
            print(f"    sync {n:g}/step  {site}")


def print_breakdown(rows: dict[str, Any]) -> None:
    """Print rank 0's per-task times and where the engine's time falls, per variant."""
    print("rank 0 task bodies, ms/step (median), by task [thread]:")
    for name, r in rows.items():
        if "rank0_task_ms_per_step" in r:
            tasks = ", ".join(f"{t} {ms:.2f} [{r['thread_of'][t]}]" for t, ms in r["rank0_task_ms_per_step"].items())
            print(f"  {name:<36} {tasks}")
    print("rank 0 engine µs/step (median) by where it falls:")
    for name, r in rows.items():
        if "rank0_engine_us_per_step_by_position" in r:
            where = ", ".join(f"{k} {us:.0f}" for k, us in r["rank0_engine_us_per_step_by_position"].items())
            print(f"  {name:<36} {where}")


# -- main -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    """The command line; `--quick` fills in the smoke test's sizes and turns the speed gate off."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--batch-sizes", default=",".join(map(str, BATCH_SIZES)), help="per-rank batch sizes to sweep (32,256,1024)"
    )
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repetitions per batch size (default 7)")
    parser.add_argument("--steps", type=int, default=None, help=f"timed steps per run (default per batch: {STEPS})")
    parser.add_argument("--warmup", type=int, default=None, help=f"untimed steps first (default per batch: {WARMUP})")
    parser.add_argument("--variants", default=None, help="comma-separated subset of the variants (default: all)")
    parser.add_argument(
        "--plan",
        action="append",
        default=[],
        metavar="NAME=OVERRIDES",
        help="an extra engine variant: a name, '=', then space-separated config overrides, e.g. "
        "--plan 'tuned=pipeline=tuned thread_map=plan hydra.searchpath=[file:///tmp/plans]' (repeatable)",
    )
    parser.add_argument(
        "--max-other-load",
        type=float,
        default=0.10,
        help="discard and rerun a repetition during which other jobs used more than this share of all cores "
        "(default 0.10)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=None,
        help="discarded repetitions allowed per batch size (default: twice --repeats)",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pin each rank (and every thread it starts) to its own core; default: on for CPU runs, off on CUDA",
    )
    parser.add_argument(
        "--min-vs-class",
        type=float,
        default=None,
        help=f"fail when a plan's median speed vs its torchrec class is below this in a clean window "
        f"(default {MIN_VS_CLASS}; 0 turns the gate off; --quick: off)",
    )
    parser.add_argument(
        "--host",
        action="store_true",
        help="also count, per plan and task, the aten operators, kernel launches and host syncs of a step "
        "(recsys_pipe.bench.host_ops); on CUDA also the GPU's busy ms per step",
    )
    parser.add_argument("--host-steps", type=int, default=4, help="steps --host counts (default 4)")
    parser.add_argument("--quick", action="store_true", help="CI smoke test: batch 16, 3 steps, 1 repetition")
    args = parser.parse_args()
    if args.quick:  # a smoke test: keep whatever the machine gives
        args.batch_sizes, args.repeats, args.steps, args.warmup, args.retries = "16", 1, 3, 1, 0
    if args.min_vs_class is None:
        args.min_vs_class = 0.0 if args.quick else MIN_VS_CLASS
    if args.retries is None:
        args.retries = 2 * args.repeats
    extra: dict[str, tuple[str, ...]] = {}
    for spec in args.plan:
        name, sep, overrides = spec.partition("=")
        if not sep or not name or not overrides.strip() or name in PLANS:
            parser.error(f"--plan must be NAME=OVERRIDES with a new name, got {spec!r}")
        extra[name] = tuple(shlex.split(overrides))
    args.plan = extra
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        parser.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    if min(args.batch_sizes) < 1 or args.repeats < 1 or (args.steps or 1) < 1 or (args.warmup or 1) < 1:
        parser.error("--batch-sizes, --repeats, --steps and --warmup must be >= 1")
    return args


def main() -> None:
    """Run the benchmark on this rank: every batch size, every repetition; rank 0 prints the report."""
    args = parse_args()
    if args.pin is None:
        args.pin = not torch.cuda.is_available()
    if args.pin:  # before any thread starts, so gloo's and the executor's threads inherit it
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", 0)) % len(cores)]})
    one_thread_per_rank()
    from recsys_pipe.runtime import init_distributed

    cuda = torch.cuda.is_available()
    info = init_distributed("cuda" if cuda else "cpu", "nccl" if cuda else "gloo")
    main_rank = info.rank == 0
    plans, variants = choose_variants(args, cuda)
    machine = describe_machine(info, args.pin, cuda)
    if main_rank:
        print(
            f"bench_train: {info.world_size} ranks ({info.backend}, {machine['device']}, {machine['cores']} cores: "
            f"{machine['cpu']}), 1 intra-op thread per rank; batch sizes {args.batch_sizes}, "
            f"{args.repeats} repetition(s){', each rank pinned to one core' if args.pin else ''}; "
            f"variants: {', '.join(variants)}",
            flush=True,
        )
    report: dict[str, Any] = {"machine": machine, "repeats": args.repeats, "batches": {}}
    rss_problem = None
    for batch_size in args.batch_sizes:
        rss_problem = measure_batch_size(info, args, batch_size, plans, variants, report)
    report["targets"] = targets(report, variants, cuda)
    report["speed_gate"] = speed_gate(report, args.min_vs_class, args.max_other_load)
    if rss_problem:
        report["rss_problem"] = rss_problem
    if main_rank:
        print(f"\nobserver cost (its hooks timed alone): {report['observer_us_per_step']} µs/step")
        if rss_problem:
            print(rss_problem)
        print_targets(report["targets"])
        print_speed_gate(report["speed_gate"])
        print(json.dumps(report), flush=True)
    enforce_speed_gate(report["speed_gate"], main_rank)


def choose_variants(args: argparse.Namespace, cuda: bool) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """The plans by name (the shipped ones, `--plan`'s, and with `--variants` every plan file) and
    the variants to run, in order: every plan and torchrec's classes, or `--variants`' choice
    (SystemExit naming an unknown one, or a torchrec class that needs CUDA on a CPU machine)."""
    plans = {**PLANS, **args.plan}
    if not args.variants:
        return plans, [*plans, TORCHREC] + ([TORCHREC_PREFETCH] if cuda else [])
    from recsys_pipe.config import CONF_DIR

    files = {p.stem: (f"pipeline={p.stem}",) for p in sorted((CONF_DIR / "pipeline").glob("*.yaml"))}
    plans = {**files, **plans}
    known = [*plans, *TORCHREC_CLASSES]
    chosen = args.variants.split(",")
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise SystemExit(f"error: --variants: unknown {unknown}; choose from {known}")
    cuda_only = [v for v in chosen if v in TORCHREC_CLASSES and not TORCHREC_CLASSES[v][2]]
    if cuda_only and not cuda:
        raise SystemExit(
            f"error: --variants: {cuda_only} need CUDA: on the CPU torchrec 1.8 fails in Tensor.record_stream "
            "(RuntimeError: unknown parameter type)"
        )
    return plans, list(dict.fromkeys(chosen))


def describe_machine(info: Any, pinned: bool, cuda: bool) -> dict[str, Any]:
    """What the report says of the machine: CPU model, cores, device, backend, ranks, versions."""
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "device": torch.cuda.get_device_name(info.device) if cuda else "cpu",
        "backend": info.backend,
        "ranks": info.world_size,
        "pinned": pinned,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    with open("/proc/cpuinfo") as f:
        model = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    if model:
        machine["cpu"] = model[0]
    return machine


def measure_batch_size(
    info: Any,
    args: argparse.Namespace,
    batch_size: int,
    plans: dict[str, tuple[str, ...]],
    variants: list[str],
    report: dict[str, Any],
) -> str | None:
    """Every variant at `batch_size`, `args.repeats` clean interleaved repetitions, into
    `report["batches"]` (rank 0 prints the table); returns the memory probe's problem, if any."""
    from recsys_pipe.train import training_plan

    cuda, main_rank, cores = info.device.type == "cuda", info.rank == 0, os.cpu_count() or 1
    steps = args.steps or STEPS.get(batch_size, max(4, 1536 // batch_size))
    warmup = args.warmup or WARMUP.get(batch_size, 3)
    bench = Bench(info, batch_size, warmup, steps, {name: plans[name] for name in variants if name in plans})
    if "observer_us_per_step" not in report:
        tasks = max(len(training_plan(run).graph.order) for run in bench.runs.values())
        report["observer_us_per_step"] = round(observer_cost_us(tasks), 2)
    records, discarded = repetitions(bench, args, batch_size, steps, variants, main_rank)
    equal = check_losses(records, cuda, info.rank)
    rows = aggregate(records, batch_size, steps, info.world_size, cores)
    if args.host:
        for name in (v for v in variants if v in plans):
            rows[name]["host"] = bench.count_host(name, min(args.host_steps, steps))
    report["batches"][str(batch_size)] = {
        "steps": steps,
        "warmup": warmup,
        "discarded_repetitions": discarded,
        "variants": rows,
        "losses": equal,
    }
    if main_rank:
        print_table(batch_size, steps, args.repeats, info.world_size, rows)
        print_breakdown(rows)
        if args.host:
            print_host(rows)
        print(f"losses: {equal['note']}", flush=True)
    return bench.memory.problem


def repetitions(
    bench: Bench, args: argparse.Namespace, batch_size: int, steps: int, variants: list[str], main_rank: bool
) -> tuple[dict[str, list[list[dict[str, Any]]]], int]:
    """`args.repeats` repetitions of every variant, each starting one variant further along, the
    ranks' figures gathered; a repetition during which other jobs used more than
    `--max-other-load` of the cores is discarded and run again after a pause (up to
    `--retries`). Returns the kept repetitions per variant and how many were discarded."""
    cores = os.cpu_count() or 1
    records: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
    started = time.perf_counter()
    rep = discarded = in_a_row = 0
    while rep < args.repeats:
        shift = rep % len(variants)
        this: dict[str, list[dict[str, Any]]] = {}
        for name in variants[shift:] + variants[:shift]:
            gathered: list[Any] = [None] * bench.info.world_size
            dist.all_gather_object(gathered, bench.run(name))
            this[name] = gathered
        other = max(other_load(runs, cores) for runs in this.values())
        ms = ", ".join(f"{v} {max(r['seconds'] for r in this[v]) / steps * 1e3:.1f}" for v in variants)
        line = f"  batch {batch_size} repetition {rep + 1}/{args.repeats} ({time.perf_counter() - started:.0f} s)"
        if other > args.max_other_load and discarded < args.retries:
            discarded += 1  # every rank computed the same figure from the same gathered records
            in_a_row += 1
            pause = min(60, 10 * in_a_row)  # let a burst of other work pass
            if main_rank:
                print(
                    f"{line}: other jobs used {other:.0%} of the cores; discarded, run again in {pause} s", flush=True
                )
            time.sleep(pause)
            continue
        in_a_row = 0
        for name, runs in this.items():
            records[name].append(runs)
        rep += 1
        if main_rank:
            print(f"{line}: ms/step {ms}; other jobs {other:.0%}", flush=True)
    return records, discarded


def check_losses(records: dict[str, list[list[dict[str, Any]]]], cuda: bool, rank: int) -> dict[str, Any]:
    """CPU: every run's per-step losses bitwise equal to serial's first run, on every rank
    (raises otherwise). CUDA: the largest difference of the last loss, reported."""
    groups: dict[str, dict[str, Any]] = {}
    for name, reps in records.items():
        groups.setdefault(STALE.get(name, ""), {})[name] = reps
    notes = {group: check_loss_group(members, cuda, rank) for group, members in groups.items()}
    if len(notes) == 1:
        return next(iter(notes.values()))
    return {
        "checked": all(n["checked"] for n in notes.values()),
        "equal": all(n.get("equal", False) for n in notes.values()),
        "runs": sum(n.get("runs", 0) for n in notes.values()),
        "steps": next(iter(notes.values())).get("steps"),
        "note": "; ".join(f"stale embeddings ({g}): {n['note']}" if g else n["note"] for g, n in notes.items()),
    }


def check_loss_group(records: dict[str, list[list[dict[str, Any]]]], cuda: bool, rank: int) -> dict[str, Any]:
    """`check_losses` for one group of variants that train the same numbers."""
    runs = [(name, r, rep[rank]["losses"]) for name, reps in records.items() for r, rep in enumerate(reps)]
    reference_name = "serial" if "serial" in records else runs[0][0]
    reference = records[reference_name][0][rank]["losses"]
    if cuda:
        diff = max(abs(losses[-1] - reference[-1]) for _, _, losses in runs)
        return {
            "checked": False,
            "max_last_loss_diff": diff,
            "note": f"CUDA: not asserted; last losses differ by at most {diff:.3g}",
        }
    mismatches = [f"{name}[rep {r}]" for name, r, losses in runs if losses != reference]
    ok = torch.tensor([0 if mismatches else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        raise AssertionError(
            f"rank {rank}: per-step losses differ from {reference_name}'s for {mismatches or 'another rank'}"
        )
    return {
        "checked": True,
        "equal": True,
        "runs": len(runs),
        "steps": len(reference),
        "note": f"per-step losses of all {len(runs)} runs ({len(reference)} steps each) bitwise equal on every rank",
    }


def targets(report: dict[str, Any], variants: list[str], cuda: bool) -> dict[str, Any]:
    """Which targets each batch size meets (speed only for the CPU batch sizes it names)."""
    out: dict[str, Any] = {
        "limits": {
            "speed_vs_torchrec_min": TARGET_SPEED,
            "speed_batch_sizes": list(TARGET_SPEED_BATCHES),
            "peak_rss_vs_torchrec_max": TARGET_RSS,
            "engine_share_percent_max": TARGET_ENGINE_SHARE,
        },
        "met": {},
    }
    if TORCHREC not in variants:
        return out
    for batch_size, entry in report["batches"].items():
        rows = entry["variants"]
        met: dict[str, Any] = {}
        for name in (v for v in rows if v != "serial" and v not in TORCHREC_CLASSES):  # the plans with lookaheads
            r = rows[name]
            checks: dict[str, bool] = {}
            if not cuda and int(batch_size) in TARGET_SPEED_BATCHES:
                checks["speed"] = r["vs_torchrec"]["median"] >= TARGET_SPEED
            if "rss_vs_torchrec" in r:
                checks["peak_rss"] = r["rss_vs_torchrec"] <= TARGET_RSS
            checks["engine_share"] = r["engine_share_percent"]["median"] <= TARGET_ENGINE_SHARE
            met[name] = checks
        out["met"][batch_size] = met
    return out


def print_targets(t: dict[str, Any]) -> None:
    """Print which targets every plan with lookaheads meets, per batch size."""
    limits = t["limits"]
    print(
        f"targets: plans with lookaheads >= {limits['speed_vs_torchrec_min']}x torchrec_sdd (median, CPU, batch "
        f"{'/'.join(map(str, limits['speed_batch_sizes']))}), peak RSS <= {limits['peak_rss_vs_torchrec_max']}x "
        f"torchrec_sdd's, engine <= {limits['engine_share_percent_max']} % of a step"
    )
    for batch_size, met in t["met"].items():
        for name, checks in met.items():
            print(
                f"  batch {batch_size:>5} {name:<28} "
                + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in checks.items())
            )


def speed_gate(report: dict[str, Any], min_ratio: float, max_other_load: float) -> dict[str, Any]:
    """The speed gate's verdict on every plan that ran next to its torchrec class.

    Args:
        report: the benchmark's report: `report["batches"][batch]["variants"]` are the rows of
            `aggregate`, whose "vs_counterpart" and "other_load_percent" the gate reads.
        min_ratio: the least median speed ratio plan / class that passes (0: the gate is off).
        max_other_load: the share of all cores other jobs may use in every kept repetition of
            the plan and its class for the pair to count as measured in a clean window.

    Returns:
        `{"min_ratio", "max_other_load", "passed", "failed", "not_clean"}`; the last three list
        `{"batch_size", "plan", "class", "ratio", "other_load"}` (other_load: the largest share
        of the cores other jobs used in a kept repetition of either). Empty lists when off.
    """
    out: dict[str, Any] = {
        "min_ratio": min_ratio,
        "max_other_load": max_other_load,
        "passed": [],
        "failed": [],
        "not_clean": [],
    }
    if min_ratio <= 0:
        return out
    for batch_size, entry in report["batches"].items():
        rows = entry["variants"]
        for name, row in rows.items():
            if "vs_counterpart" not in row:
                continue
            counterpart = row["vs_counterpart"]["variant"]
            other = max(rows[v]["other_load_percent"]["max"] for v in (name, counterpart)) / 100
            verdict = {
                "batch_size": int(batch_size),
                "plan": name,
                "class": counterpart,
                "ratio": row["vs_counterpart"]["median"],
                "other_load": round(other, 3),
            }
            if other > max_other_load:
                out["not_clean"].append(verdict)
            elif verdict["ratio"] < min_ratio:
                out["failed"].append(verdict)
            else:
                out["passed"].append(verdict)
    return out


def _verdict_line(v: dict[str, Any]) -> str:
    other = f"other jobs at most {v['other_load']:.0%}"
    return f"batch {v['batch_size']} {v['plan']}: {v['ratio']:.3f}x {v['class']} ({other})"


def print_speed_gate(gate: dict[str, Any]) -> None:
    """Print the gate's verdicts: passed, failed, and the pairs not judged for a noisy window."""
    if gate["min_ratio"] <= 0:
        print("speed gate: off")
        return
    print(
        f"speed gate: every plan >= {gate['min_ratio']}x its torchrec class (median), judged where other jobs "
        f"used at most {gate['max_other_load']:.0%} of the cores"
    )
    for v in gate["passed"]:
        print(f"  passed      {_verdict_line(v)}")
    for v in gate["failed"]:
        print(f"  FAILED      {_verdict_line(v)}")
    for v in gate["not_clean"]:
        print(f"  not judged  {_verdict_line(v)}: the window was not clean")
    if not (gate["passed"] or gate["failed"] or gate["not_clean"]):
        print("  no plan ran next to its torchrec class")


def enforce_speed_gate(gate: dict[str, Any], main_rank: bool = True) -> None:
    """Fail the run when a plan fell below the gate in a clean window: the verdicts on stderr
    (from rank 0), then `SystemExit(1)` on every rank (they all hold the same gathered report).
    A pair measured in a window that was not clean is warned about on stderr and never fails."""
    if main_rank:
        for v in gate["not_clean"]:
            print(
                f"bench_train: warning: not judged, the window was not clean: {_verdict_line(v)}",
                file=sys.stderr,
            )
        for v in gate["failed"]:
            print(
                f"bench_train: plan {v['plan']} at {v['ratio']:.3f}x of {v['class']} (batch {v['batch_size']}), "
                f"below the gate's {gate['min_ratio']}x in a clean window",
                file=sys.stderr,
            )
        sys.stderr.flush()
    if gate["failed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    if not any(a in ("-h", "--help") for a in sys.argv):
        reexec_under_torchrun(__spec__.name, NPROC)  # plain `python -m recsys_pipe.bench.train`: 2 ranks
    run_ranks(main)
