"""Plan compiler: Hydra/YAML config -> validated pydantic sections -> engine dependency graph.

Imports only the engine, pydantic and omegaconf (never Hydra, which lives in `recsys_pipe.cli`).

    plan = compile_plan(run.pipeline)                      # CompiledPlan, or ConfigError
    plan = compile_plan(cfg, resolve_fn=structure_only)    # structure only, no task code imported

Every problem is reported as `ConfigError.problems`: (config path, message) pairs. `Section` is
the base of every component's config; `Registry` maps component names to their config classes;
`TASKS` maps task names (`fn: h2d`) to the functions registered with `@task`.
"""

from recsys_pipe.config.compile import CompiledPlan, CpuEdge, compile_plan, plan_from_any, thread_assignment
from recsys_pipe.config.errors import ConfigError, ConfigProblem, UserCodeError, format_path, suggest
from recsys_pipe.config.load import to_container, validate_section
from recsys_pipe.config.paths import CONF_DIR, home_expanded
from recsys_pipe.config.registry import Component, Registry, builder_config_class, builder_field
from recsys_pipe.config.render import firing_table, render_plan
from recsys_pipe.config.resolve import FnResolveError, import_fn, structure_only
from recsys_pipe.config.schema import TASK_FIELDS, PlanConfig, Section, TaskConfig, ThreadMapConfig
from recsys_pipe.config.structured import plan_skeleton
from recsys_pipe.config.task_registry import (
    TASKS,
    Need,
    TaskRegistry,
    TaskSpec,
    UnknownTaskError,
    task,
    task_options,
)

__all__ = [
    "CONF_DIR",
    "home_expanded",
    "TASKS",
    "TASK_FIELDS",
    "CompiledPlan",
    "Component",
    "ConfigError",
    "ConfigProblem",
    "CpuEdge",
    "FnResolveError",
    "Need",
    "PlanConfig",
    "Registry",
    "Section",
    "TaskConfig",
    "TaskRegistry",
    "TaskSpec",
    "ThreadMapConfig",
    "UnknownTaskError",
    "UserCodeError",
    "compile_plan",
    "builder_config_class",
    "builder_field",
    "firing_table",
    "format_path",
    "import_fn",
    "plan_from_any",
    "plan_skeleton",
    "render_plan",
    "structure_only",
    "suggest",
    "task",
    "task_options",
    "thread_assignment",
    "to_container",
    "validate_section",
]
