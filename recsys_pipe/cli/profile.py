"""`recsys-profile`: where the time of a training step goes, for the configured model and plan.

    recsys-profile pipeline=serial                            # one process
    torchrun --nproc_per_node 2 --no-python recsys-profile pipeline=hstu_prefetch
    scripts/profile.sh                                        # the same, 2 ranks, HSTU prefetch plan

Same config tree and overrides as `recsys-train` (plus `profile.*`). It builds the trainer's
parts (loaders, sharded model, streams, the plan's pipeline), rewrites the model on the first
batch and runs a few batches, then measures passes of `profile.warmup + profile.iters`
training steps through the pipeline with a `CostProfiler` installed (`TaskProfiler`): one
baseline pass, then with `profile.exposed=true` one pass per task that can be replayed, with
that task shortcut. Rank 0 writes into `<trainer.output_dir>/recsys-profile/<time>/`:

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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from pydantic import Field, StrictBool, StrictInt, StrictStr

from recsys_pipe.cli.app import hydra_app
from recsys_pipe.cli.console import show_library_warnings
from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem, Section, suggest
from recsys_pipe.train.config import RunConfig, load_run_config
from recsys_pipe.train.plan import training_plan

if TYPE_CHECKING:
    from recsys_pipe.autosched import ProfileResult
    from recsys_pipe.train import Trainer

__all__ = ["ProfileCommandConfig", "ProfileConfig", "main", "profile_task", "run"]

log = logging.getLogger("recsys_pipe")

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


def _check(run: ProfileCommandConfig, plan: CompiledPlan, batches: int | None = None) -> None:
    """Config problems found before any process group starts (`batches`: this rank's training
    batches per epoch, once its data is read)."""
    problems = []
    names = [t.name for t in plan.order]
    for i, name in enumerate(run.profile.tasks or ()):
        if name not in names:
            problems.append(
                ConfigProblem(
                    f"profile.tasks[{i}]", f"unknown task '{name}'{suggest(name, names)} (known: {', '.join(names)})"
                )
            )
    needed = max(run.profile.warmup, plan.schedule.max_lookahead) + run.profile.iters
    if run.data.num_batches is not None and run.data.num_batches < needed:
        problems.append(
            ConfigProblem(
                "data.num_batches",
                f"{run.data.num_batches} batches per rank; each profiling pass needs {needed} "
                f"(profile.warmup or the max lookahead, plus profile.iters)",
            )
        )
    elif batches is not None and batches < needed:
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
    from recsys_pipe.runtime import check_output_dir

    check_output_dir(run.trainer.output_dir)  # as recsys-train: refused before any process group


def profile_task(cfg: DictConfig) -> None:
    run = load_run_config(cfg, ProfileCommandConfig)
    show_library_warnings(int(os.environ.get("RANK", 0)), run.debug)
    plan = training_plan(run)
    _check(run, plan)
    from recsys_pipe.cli.preflight import check_inputs, run_device
    from recsys_pipe.pp.config import check_pipeline_parallel
    from recsys_pipe.train.build import rank_data

    device = run_device(run.trainer)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    check_pipeline_parallel(run, world_size)
    data = rank_data(run, rank, world_size)
    check_inputs(run, data, device.type)
    _check(run, plan, data.batches_per_epoch)

    from recsys_pipe.runtime import init_distributed, shared_run_dir, teardown
    from recsys_pipe.train import Trainer

    info = init_distributed(run.trainer.device, run.trainer.backend)
    trainer = None
    try:
        run_dir = Path(shared_run_dir(run.trainer.output_dir, "recsys-profile"))
        _setup_logging(info.rank)
        if info.is_main:
            container = OmegaConf.to_container(cfg, resolve=True)
            (run_dir / "config.yaml").write_text(
                OmegaConf.to_yaml({k: v for k, v in container.items() if k != "hydra"})
            )
            log.info(
                "profiling plan %s on %d rank(s), %s; run dir %s",
                plan.config.name,
                info.world_size,
                info.device,
                run_dir,
            )
        trainer = Trainer(run, plan, info, data=data)
        pipelined = getattr(trainer.state.model, "record_timelines", None)  # parallel.pp
        if pipelined is not None:
            pipelined()
        result = _measure(trainer, run.profile)
        pp_written = []
        if pipelined is not None:  # each rank's F/B/W timeline of the last step, and its bubble
            pp_written = trainer.state.model.write_step_timeline(run_dir, run.parallel.pp.resolved())
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
            for path in [*written, *pp_written]:
                print(f"wrote {path}")
            sys.stdout.flush()
    finally:
        if trainer is not None:
            trainer.close()
    teardown()


def _measure(trainer: Trainer, options: ProfileConfig) -> ProfileResult:
    """Rewrite the model on the first batch, run a few steps, then the TaskProfiler passes."""
    from recsys_pipe.autosched import TaskProfiler

    pipeline, loader = trainer.pipeline, trainer.data.train_loader()
    batches = iter(loader)
    first = next(batches)
    start = itertools.islice(batches, _BOOTSTRAP_BATCHES)
    pipeline.seed_first_batch(start, trainer.state.bootstrap(first))
    for _ in pipeline.iterate(start):  # drained: nothing of it stays in flight
        pass
    profiler = TaskProfiler(
        pipeline,
        lambda: itertools.islice(iter(loader), profiler.batches_needed),  # fresh batches, just enough
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
        predicted = simulate(plan.schedule, result.costs, thread_map, statistic=statistic).iteration_s
        error = predicted / measured - 1 if measured else float("nan")
        print(
            f"simulated from the {statistic} costs: {predicted * 1e3:.3f} ms per step "
            f"(measured {statistic} {(measured or 0) * 1e3:.3f} ms, {error:+.1%})"
        )


def _setup_logging(rank: int) -> None:
    """Rank 0: INFO to the console; other ranks: warnings only."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(f"[%(asctime)s][rank {rank}][%(levelname)s] %(message)s", "%H:%M:%S"))
    root.addHandler(console)
    root.setLevel(logging.WARNING)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)


_app = hydra_app(
    profile_task, config_name="profile", prog="recsys-profile", schema="recsys_pipe.cli.profile:ProfileCommandConfig"
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
