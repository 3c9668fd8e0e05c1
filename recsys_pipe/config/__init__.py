"""Plan compiler: Hydra/YAML config -> validated pydantic models -> engine Schedule.

Imports only the engine, pydantic and omegaconf (never Hydra, which lives in `recsys_pipe.cli`).

    run = load_run_config(cfg)                       # RunConfig, or ConfigError
    schedule, pool, executor = build_pipeline_parts(run.pipeline)
    plan = compile_plan(run.pipeline, resolve_fn=structure_only)   # no task code imported

Every problem is reported as `ConfigError.problems`: (config path, message) pairs.
"""

from recsys_pipe.config.compile import (
    CompiledPlan,
    CpuEdge,
    build_pipeline_parts,
    compile_plan,
    plan_from_any,
    thread_assignment,
)
from recsys_pipe.config.errors import ConfigError, ConfigProblem, format_path, suggest
from recsys_pipe.config.load import load_run_config, to_container
from recsys_pipe.config.render import firing_table, render_plan
from recsys_pipe.config.resolve import FnResolveError, import_fn, structure_only
from recsys_pipe.config.schema import (
    TASK_FIELDS,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    PlanCommandConfig,
    PlanConfig,
    RunConfig,
    SparseOptimizerConfig,
    TaskConfig,
    ThreadMapConfig,
    TrainerConfig,
)
from recsys_pipe.config.structured import plan_skeleton

__all__ = [
    "TASK_FIELDS",
    "CompiledPlan",
    "ConfigError",
    "ConfigProblem",
    "CpuEdge",
    "DataConfig",
    "FnResolveError",
    "ModelConfig",
    "OptimizerConfig",
    "PlanCommandConfig",
    "PlanConfig",
    "RunConfig",
    "SparseOptimizerConfig",
    "TaskConfig",
    "ThreadMapConfig",
    "TrainerConfig",
    "build_pipeline_parts",
    "compile_plan",
    "firing_table",
    "format_path",
    "import_fn",
    "load_run_config",
    "plan_from_any",
    "plan_skeleton",
    "render_plan",
    "structure_only",
    "suggest",
    "thread_assignment",
    "to_container",
]
