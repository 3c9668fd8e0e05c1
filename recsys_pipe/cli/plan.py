"""`recsys-plan`: compile a plan from the Hydra config and show its task graph; never trains.

    recsys-plan pipeline=hstu_prefetch thread_map=per_task pipeline.tasks.h2d.lookahead=3
    recsys-plan pipeline=serial plot=true        # + PNG timing diagram and DAG in the run dir
    recsys-plan model=dlrm model.sharding=planner world_size=8 local_world_size=4
    recsys-plan model=dlrm world_size=64 local_world_size=8 device=cuda memory_gib=80 dry_run=true

After the task graph it shows the model's side: torchrec's printout of the embedding sharding plan
for `world_size` ranks (`local_world_size` per host) on the trainer's device type, or, for a model
with plain torch tables, its data parallelism (`trainer.dense_ddp`); and which tasks have nothing
to do.

With `memory_gib` (the memory of one rank's device) it prints the estimated peak memory of every
rank, broken down by part, and one line: the largest rank, its GiB and whether it fits
(`recsys_pipe.train.memory`); with `dry_run=true` it also builds one rank's table shards for
real under torch's fake process group (one process) and compares them with the estimate.

Same config tree and loader as `recsys-train`, so a plan that prints here is the plan that
trains, and a plan refused here (exit 2, `error: <path>: <message>`) is refused there.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from omegaconf import DictConfig, OmegaConf
from pydantic import Field, StrictBool, StrictInt, StrictStr

from recsys_pipe.cli.app import HydraApp
from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem, render_plan, structure_only
from recsys_pipe.train.build import describe_model
from recsys_pipe.train.config import RunConfig, load_run_config
from recsys_pipe.train.dense_ddp import check_dense_ddp
from recsys_pipe.train.parallel import Topology
from recsys_pipe.train.plan import planned_device_type, training_plan

__all__ = ["PlanCommandConfig", "plan_task", "run", "main"]


class PlanCommandConfig(RunConfig):
    """`recsys-plan`'s config: the run config plus the printer's own options (conf/plan.yaml)."""

    plot: StrictBool = Field(False, description="also draw plan_timing.png and plan_dag.png into the run dir")
    check_fns: StrictBool = Field(True, description="import every task fn (false: check the structure only)")
    num_batches: StrictInt = Field(4, ge=1, le=64, description="batches drawn in the timing table")
    world_size: StrictInt = Field(1, ge=1, description="ranks the embedding sharding plan is shown for")
    local_world_size: StrictInt | None = Field(None, ge=1, description="ranks per host (null: world_size)")
    device: Literal["cpu", "cuda"] | None = Field(
        None, description="device type the plans are made for (null: trainer.device's; auto: cuda if visible)"
    )
    memory_gib: float | None = Field(
        None, gt=0, description="memory of one rank's device: print the estimated peak memory per rank and if it fits"
    )
    dry_run: StrictBool = Field(
        False,
        description="also build rank dry_run_rank's table shards for real under torch's fake process group (one "
        "process, no GPU needed) and compare them with the estimate",
    )
    dry_run_rank: StrictInt = Field(0, ge=0, description="the rank the dry run builds")
    costs: StrictStr | None = Field(
        None, description="per-task costs (costs.json of the profiler): print the simulated step time"
    )
    tune: StrictBool = Field(False, description="with costs: search a faster plan and write it as a plan file")
    tune_name: StrictStr | None = Field(None, description="name of the tuned plan (default: <plan>_tuned)")
    tune_time_limit_s: float | None = Field(60.0, gt=0, description="wall-clock budget of the plan search")


def _output_dir() -> Path | None:
    from recsys_pipe.cli.hydra_adapter import hydra_runtime

    runtime = hydra_runtime()
    return None if runtime is None else runtime.output_dir


def plan_task(cfg: DictConfig) -> None:
    """Validate, compile, print; write plan.txt (+ PNGs with plot=true) into the run dir."""
    run_cfg = load_run_config(cfg, PlanCommandConfig)
    if run_cfg.tune and run_cfg.costs is None:
        raise ConfigError(ConfigProblem("tune", "tune=true needs costs=<costs.json> (per-task costs to simulate)"))
    plan = training_plan(run_cfg, resolve_fn=None if run_cfg.check_fns else structure_only)
    topology = _topology(run_cfg)
    check_dense_ddp(run_cfg, topology.device_type)
    costs = None
    if run_cfg.costs is not None:
        from recsys_pipe.cli.predict import load_costs

        costs = load_costs(run_cfg.costs, plan)
    text = render_plan(plan, run_cfg.num_batches)
    model_text = None
    if run_cfg.check_fns:  # structure-only mode imports no model code either
        model_text = describe_model(run_cfg, plan, topology.world_size, topology.local_world_size, topology.device_type)
        memory_text = _memory(run_cfg, plan, topology)
        if memory_text:
            model_text += "\n\n" + memory_text
    print(text)
    from recsys_pipe.train.parallel import parallelism_of

    steps_text = parallelism_of(run_cfg).describe_steps()  # what each rank runs of a step, if more than the plan
    if steps_text:
        print()
        print(steps_text)
    if model_text:
        print()
        print(model_text)
    out = _output_dir()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.txt").write_text(text + "\n" + (f"\n{steps_text}\n" if steps_text else ""))
        if model_text:
            (out / "model.txt").write_text(model_text + "\n")
    written = [] if out is None else [out / "plan.txt"] + ([out / "model.txt"] if model_text else [])
    if costs is not None:
        from recsys_pipe.cli.predict import predict, tune_plan

        written += predict(plan, costs, out, run_cfg.plot)
        if run_cfg.tune:
            name = run_cfg.tune_name or f"{plan.config.name or 'plan'}_tuned"
            spelled = {  # the options as the plan file spells them (interpolations kept)
                task: OmegaConf.to_container(node.options, resolve=False)
                for task, node in cfg.pipeline.tasks.items()
                if node.get("options")
            }
            written += tune_plan(plan, costs, name, out or Path.cwd(), run_cfg.tune_time_limit_s, spelled)
    if out is None:
        return
    if run_cfg.plot:
        from recsys_pipe.cli.plot import plot_dag, plot_timing, write_dot

        written.append(plot_timing(plan, out / "plan_timing.png", run_cfg.num_batches))
        written.append(plot_dag(plan, out / "plan_dag.png"))
        written.extend(write_dot(plan, out / "plan_dag.dot"))
    print()
    print(f"run dir: {out}  (resolved config: {out / '.hydra' / 'config.yaml'})")
    for p in written:
        print(f"wrote {p}")
    sys.stdout.flush()


def _topology(run_cfg: PlanCommandConfig) -> Topology:
    """The ranks the plans are shown for, checked (ConfigError at `local_world_size`)."""
    device = run_cfg.device or planned_device_type(run_cfg.trainer.device)
    topology = Topology(run_cfg.world_size, run_cfg.local_world_size or run_cfg.world_size, device, "local_world_size")
    topology.check()
    return topology


def _memory(run_cfg: PlanCommandConfig, plan: CompiledPlan, topology: Topology) -> str | None:
    """The memory table (`memory_gib` or `dry_run`) and the dry run's comparison, if asked for."""
    if run_cfg.memory_gib is None and not run_cfg.dry_run:
        return None
    from recsys_pipe.train.memory import NOT_ESTIMATED, dry_run_report, dry_run_tables, estimate_memory

    estimate = estimate_memory(run_cfg, plan, topology, run_cfg.memory_gib)
    if estimate is None:
        return NOT_ESTIMATED
    text = estimate.render()
    if run_cfg.dry_run:
        if run_cfg.dry_run_rank >= topology.world_size:
            raise ConfigError(
                ConfigProblem("dry_run_rank", f"rank {run_cfg.dry_run_rank} is not one of {topology.world_size}")
            )
        measured = dry_run_tables(run_cfg, topology, run_cfg.dry_run_rank)
        text += "\n" + dry_run_report(estimate, measured, run_cfg.dry_run_rank)
    return text


def check_config(cfg: DictConfig) -> None:
    """Checked before Hydra creates the run directory: the config, the plan, and that run
    directories can be made under `trainer.output_dir` (nothing is created here)."""
    run_cfg = load_run_config(cfg, PlanCommandConfig)
    training_plan(run_cfg, resolve_fn=None if run_cfg.check_fns else structure_only)
    _check_creatable(Path(run_cfg.trainer.output_dir))


def _check_creatable(path: Path) -> None:
    """ConfigError at trainer.output_dir unless `path` is, or can be made as, a writable directory."""
    import os

    existing = path.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    reason = None
    if not existing.is_dir():
        reason = f"{existing} is not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        reason = f"{existing} is not writable"
    if reason:
        raise ConfigError(ConfigProblem("trainer.output_dir", f"cannot create run directories under {path}: {reason}"))


_app = HydraApp(
    plan_task,
    config_name="plan",
    prog="recsys-plan",
    schema="recsys_pipe.cli.plan:PlanCommandConfig",
    validate=check_config,
)


def run(argv: Sequence[str] | None = None) -> int:
    """Run `recsys-plan` in-process with `argv`; returns the exit code (0, 1 or 2)."""
    return _app.run(argv)


def main() -> None:
    """Console-script entry point (`recsys-plan`)."""
    _app.main()


if __name__ == "__main__":
    main()
