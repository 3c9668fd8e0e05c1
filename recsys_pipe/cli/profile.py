"""`recsys-profile`: where the time of a training step goes, for the configured model and plan.

    recsys-profile pipeline=serial                            # one process
    torchrun --nproc_per_node 2 --no-python recsys-profile pipeline=hstu_prefetch
    scripts/profile.sh                                        # the same, 2 ranks, HSTU prefetch plan

Same config tree and overrides as `recsys-train` (plus `profile.*`). It builds the trainer's
parts (loaders, sharded model, streams, the plan's runner), rewrites the model on the first
batch and runs a few batches, then measures passes of `profile.warmup + profile.iters`
training steps through the plan runner with a `CostProfiler` installed (`TaskProfiler`): one
baseline pass, then with `profile.exposed=true` one pass per task that can be replayed, with
that task shortcut. It starts as `recsys-train` does (`recsys_pipe.cli.launch`): the same checks
before any process group, and a run directory with `config.yaml`, `status.json` and `train.log`,
peer health and SIGTERM handling. Rank 0 writes into `<trainer.output_dir>/recsys-profile/<time>/`:

- `costs.json`: per-task costs (the simulator's input: `recsys-plan costs=<it>`);
- `exposed.json`: the iteration time, each task's exposed time and share, and why some tasks
  could not be measured;
- `trace.json`: the baseline pass's measured iterations as a Chrome/Perfetto trace;
- `timeline.png`: a few of those iterations as a Gantt chart (threads, and streams on CUDA);

and prints the table (task, stream, thread, lookahead, cpu/device ms, exposed ms, share) plus
the step the simulator predicts from the measured costs. The model trains while it is
measured (every pass runs real steps), so do not profile a run you want to keep.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig
from pydantic import Field, StrictBool, StrictInt, StrictStr

from recsys_pipe.cli.app import HydraApp
from recsys_pipe.cli.console import show_library_warnings
from recsys_pipe.cli.launch import Launch, Outcome, run_job
from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem, Section, suggest
from recsys_pipe.data import RankData
from recsys_pipe.train.config import RunConfig

if TYPE_CHECKING:
    from recsys_pipe.autosched import ProfileResult
    from recsys_pipe.train import Trainer

__all__ = ["ProfileCommandConfig", "ProfileConfig", "main", "profile_task", "run"]

log = logging.getLogger("recsys_pipe")
PROG = "recsys-profile"

#: batches run after the model rewrite, before measuring (the first pass's first iterations)
_BOOTSTRAP_BATCHES = 3


class ProfileConfig(Section):
    """What `recsys-profile` measures (`profile.*`)."""

    warmup: StrictInt = Field(3, ge=0, description="steps of each pass before measuring (at least the max lookahead)")
    iters: StrictInt = Field(20, ge=3, description="steps measured per pass (medians over these)")
    exposed: StrictBool = Field(True, description="measure each task's exposed time (one pass per task)")
    tasks: list[StrictStr] | None = Field(None, description="tasks whose exposed time to measure (null: all)")
    rounds: StrictInt = Field(3, ge=1, description="baseline + per-task passes repeated; medians over rounds")
    timeline_iterations: StrictInt = Field(3, ge=1, description="measured iterations drawn in timeline.png")


class ProfileCommandConfig(RunConfig):
    """`recsys-profile`'s config: the run config plus `profile` (conf/profile.yaml)."""

    profile: ProfileConfig = Field(default_factory=ProfileConfig, description="what to measure")


def _check(run: ProfileCommandConfig, plan: CompiledPlan, data: RankData) -> None:
    """`recsys-profile`'s own checks before any process group starts, after those every run
    makes (`recsys_pipe.train.preflight.check_run`): the tasks to measure, and enough batches."""
    problems = []
    names = [t.name for t in plan.order]
    for i, name in enumerate(run.profile.tasks or ()):
        if name not in names:
            problems.append(
                ConfigProblem(
                    f"profile.tasks[{i}]", f"unknown task '{name}'{suggest(name, names)} (known: {', '.join(names)})"
                )
            )
    needed = max(run.profile.warmup, plan.task_graph.max_lookahead) + run.profile.iters
    batches = data.batches_per_epoch
    if run.data.num_batches is not None and run.data.num_batches < needed:
        problems.append(
            ConfigProblem(
                "data.num_batches",
                f"{run.data.num_batches} batches per rank; each profiling pass needs {needed} "
                f"(profile.warmup or the max lookahead, plus profile.iters)",
            )
        )
    elif batches < needed:
        problems.append(
            ConfigProblem(
                "profile.iters",
                f"the data gives {batches} training batches per rank ({run.data.SIZE_KEY} with data.batch_size="
                f"{run.data.batch_size}); each profiling pass needs {needed} (profile.warmup or the max lookahead, "
                "plus profile.iters): lower profile.iters or data.batch_size, or use more data",
            )
        )
    if problems:
        raise ConfigError(problems)


def profile_task(cfg: DictConfig) -> None:
    """One job, started as every training command starts (`run_job`): a session with its run
    directory, status.json, peer health and SIGTERM handling; then the measurement."""
    run_job(cfg, PROG, _profile, ProfileCommandConfig, _check)


def _profile(launch: Launch, trainer: Trainer, resume: Path | None) -> Outcome:
    """Measure, then (rank 0) write the files and print the table."""
    run, plan, info, run_dir = launch.run, launch.plan, trainer.info, Path(trainer.run_dir or ".")
    assert isinstance(run, ProfileCommandConfig)
    if info.is_main:
        log.info("profiling plan %s on %d rank(s), %s", plan.config.name, info.world_size, info.device)
    parallelism, model = trainer.parts.parallelism, trainer.state.model
    parallelism.start_profiling(model)
    try:
        result = _measure(trainer, run.profile)
    except _Preempted:  # nothing half-measured is written; there is no state worth a checkpoint
        log.warning("%s received: profiling stopped on every rank, nothing written", trainer.stop.signal_name)
        return Outcome(True, {"step": trainer.step, "stop_reason": "preempted"})
    extra = parallelism.profile_files(model, run_dir)  # what the model's spread over the ranks adds
    if info.is_main:
        meta = {
            "plan": plan.config.name,
            "executor": plan.config.executor,
            "device": str(info.device),
            "world_size": info.world_size,
            "rank": info.rank,
            "iteration_s": result.baseline_s,
        }
        written = write_profile(result, run_dir, meta, run.profile.timeline_iterations)
        print(f"\nprofile of plan '{plan.config.name}' on {info.world_size} rank(s), {info.device} (rank 0):")
        result.print_report()
        _print_prediction(plan, result)
        for path in [*written, *extra]:
            print(f"wrote {path}")
        sys.stdout.flush()
    return Outcome(fields={"step": trainer.step})


class _Preempted(Exception):
    """Every rank agreed to stop (SIGTERM) before a profiling pass."""


def _measure(trainer: Trainer, options: ProfileConfig) -> ProfileResult:
    """Rewrite the model on the first batch, run a few steps, then the TaskProfiler passes;
    `_Preempted` when a SIGTERM stops them (at the next pass every rank starts)."""
    from recsys_pipe.autosched import TaskProfiler

    runner, loader = trainer.plan_runner, trainer.data.train_loader()
    batches = iter(loader)
    first = next(batches)
    start = itertools.islice(batches, _BOOTSTRAP_BATCHES)
    runner.seed_first_batch(start, trainer.state.bootstrap(first))
    for _ in runner.iterate(start):  # drained: nothing of it stays in flight
        pass

    def fresh_batches() -> Iterator:
        """A pass's batches: fresh, just enough; none once every rank agreed to stop (SIGTERM)."""
        if trainer.stop.should_stop():  # every rank asks before each pass: they stop at the same one
            raise _Preempted
        return itertools.islice(iter(loader), profiler.batches_needed)

    profiler = TaskProfiler(
        runner,
        fresh_batches,
        options.warmup,
        options.iters,
        rounds=options.rounds,
    )
    names = options.tasks if options.exposed else []  # None: every task
    return profiler.profile_many(names)


def write_profile(result: ProfileResult, out: Path, meta: dict[str, Any], timeline_iterations: int) -> list[Path]:
    """costs.json, exposed.json, trace.json and timeline.png of `result` into `out`."""
    from recsys_pipe.autosched import plot_timeline, write_chrome_trace

    costs = dataclasses.replace(result.costs, meta={**result.costs.meta, **meta})
    paths = [out / "costs.json", out / "exposed.json", out / "trace.json", out / "timeline.png"]
    costs.to_json(paths[0])
    result.to_json(paths[1])
    write_chrome_trace(result.instances, paths[2], label=f"rank {meta.get('rank', 0)}")
    n = min(timeline_iterations, len(result.iteration_spans))
    plot_timeline(
        result.instances,
        paths[3],
        time_range=result.window(last=n),
        title=f"{meta.get('plan')}: {n} measured iterations, median {result.baseline_s * 1e3:.2f} ms "
        f"({meta.get('device')}, rank {meta.get('rank', 0)})",
    )
    return paths


def _print_prediction(plan: CompiledPlan, result: ProfileResult) -> None:
    from recsys_pipe.autosched import simulate

    thread_map = dict(plan.thread_of) if plan.threaded else "sequential"
    for statistic, measured in (("median", result.baseline_s), ("mean", result.costs.meta.get("iteration_mean_s"))):
        predicted = simulate(plan.task_graph, result.costs, thread_map, statistic=statistic).iteration_s
        error = predicted / measured - 1 if measured else float("nan")
        print(
            f"simulated from the {statistic} costs: {predicted * 1e3:.3f} ms per step "
            f"(measured {statistic} {(measured or 0) * 1e3:.3f} ms, {error:+.1%})"
        )


_app = HydraApp(
    profile_task,
    config_name="profile",
    prog=PROG,
    schema="recsys_pipe.cli.profile:ProfileCommandConfig",
    check=lambda cfg: Launch.prepare(cfg, ProfileCommandConfig, _check),  # `--check`: as a job checks itself
)


def run(argv: Sequence[str] | None = None) -> int:
    """Run `recsys-profile` in-process with `argv`; returns the exit code."""
    return _app.run(argv)


def main() -> None:
    """Console-script entry point; exits with os._exit after flushing (gloo's threads can abort an
    orderly interpreter shutdown, as for recsys-train)."""
    show_library_warnings(int(os.environ.get("RANK", 0)), debug="debug=true" in sys.argv)  # before any import warns
    code = _app.run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
