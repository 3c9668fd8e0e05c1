"""`recsys-plan costs=<costs.json> [tune=true]`: predict the configured plan's step time from
per-task costs and, with tune=true, search for a faster plan and write it as a plan file.

Lives in the CLI layer: it joins the compiled plan (config) with the plan tooling
(autosched) and writes files into the run directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem

if TYPE_CHECKING:
    from recsys_pipe.autosched import CostModel

__all__ = ["load_costs", "predict", "tune_plan"]


def load_costs(path: str, plan: CompiledPlan) -> CostModel:
    """The cost model at `path`, with a cost for every task of `plan` (else ConfigError at `costs`)."""
    from recsys_pipe.autosched import CostModel

    try:
        costs = CostModel.from_json(Path(path))
    except ValueError as exc:
        raise ConfigError(ConfigProblem("costs", str(exc))) from None
    missing = [t.name for t in plan.order if t.name not in costs]
    if missing:
        raise ConfigError(
            ConfigProblem("costs", f"{path} has no cost for task(s) {', '.join(missing)} of plan '{plan.config.name}'")
        )
    return costs


def _thread_map(plan: CompiledPlan) -> dict[str, str] | str:
    return dict(plan.thread_of) if plan.threaded else "sequential"


def predict(plan: CompiledPlan, costs: CostModel, out: Path | None, plot: bool) -> list[Path]:
    """Print the simulated step time, utilisation and critical path; draw the Gantt with plot."""
    from recsys_pipe.autosched import simulate

    result = simulate(plan.task_graph, costs, _thread_map(plan))
    print(f"\nsimulated with the costs ({plan.config.name}):")
    print(result.report())
    if plot and out is not None:
        return [Path(result.plot(out / "plan_simulated.png"))]
    return []


def tune_plan(
    plan: CompiledPlan,
    costs: CostModel,
    name: str,
    out: Path,
    time_limit_s: float | None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Path]:
    """Search thread map x streams x order x lookaheads; print the diff; write `<out>/pipeline/<name>.yaml`
    (with each task's `options` as the plan file spells them: interpolations kept)."""
    from recsys_pipe.autosched import plan_yaml, tune

    try:
        result = tune(plan.task_graph, costs, _thread_map(plan), time_limit_s=time_limit_s)
    except ValueError as exc:  # the configured plan itself breaks a tuning constraint
        raise ConfigError(ConfigProblem("tune", str(exc))) from None
    print(f"\ntuned ({result.evaluations} simulated plans{', budget exhausted' if result.stopped_early else ''}):")
    print(f"predicted step of the configured plan '{plan.config.name}': {result.original_s * 1e3:.4g} ms")
    print(f"predicted step of the best plan found '{name}': {result.best_s * 1e3:.4g} ms")
    print(result.diff())
    path = out / "pipeline" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    description = f"{plan.config.name} tuned by recsys-plan: predicted {result.best_s * 1e3:.4g} ms/step"
    plan_yaml(
        result.task_graph,
        {task_name: task.fn for task_name, task in plan.config.tasks.items()},  # as the plan names them: fn: h2d
        thread_map=result.thread_map,
        name=name,
        description=description,
        executor="threaded" if len(set(result.thread_map.values())) > 1 else "sequential",
        settings={"torchrec_context": plan.config.torchrec_context},
        options=options,
        path=path,
    )
    print(
        f"train it (same model/data settings): recsys-train pipeline={name} thread_map=plan "
        f"hydra.searchpath=[file://{out.resolve()}]"
    )
    return [path]
