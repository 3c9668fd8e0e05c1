"""The plan a training run executes: `run.pipeline`, derived for the run's settings, compiled once.

Both CLIs call `training_plan(run)`, so `recsys-plan` shows exactly what `recsys-train` runs,
and the trainer receives the compiled object instead of compiling again.

Derivation: a setting that needs extra work per step adds its task to whatever plan was chosen,
instead of every plan file carrying it. `model.loss_normalization=global_tokens` adds
`global_tokens_allreduce` (the loss-token count summed over ranks) before `forward`, which reads
it; with the default `local` normalisation no plan issues that collective.

`idle_tasks` names the tasks that have nothing to do for the run (the input-dist tasks of a
model without torchrec tables, finalize_model_grads under torch DDP), for `recsys-plan` to say so.
"""

from __future__ import annotations

import importlib

from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem, PlanConfig, TaskConfig, compile_plan
from recsys_pipe.config.resolve import ResolveFn
from recsys_pipe.models.base import ShardedModelConfig
from recsys_pipe.train.config import RunConfig
from recsys_pipe.train.state import BATCH_GPU, GLOBAL_TOKENS

__all__ = ["derive_plan", "idle_tasks", "training_plan"]

_TASKS = "recsys_pipe.train.tasks"
#: task functions that need torchrec's prefetch context (`pipeline.torchrec_context: prefetch`)
PREFETCH_FNS = frozenset({f"{_TASKS}.prefetch_embeddings"})
#: task functions that distribute the input of torchrec-sharded tables
INPUT_DIST_FNS = frozenset(f"{_TASKS}.{fn}" for fn in ("start_input_dist", "wait_input_dist", "prefetch_embeddings"))
GLOBAL_TOKENS_TASK = "global_tokens_allreduce"
FINALIZE_FN = f"{_TASKS}.finalize_model_grads"


def derive_plan(plan: PlanConfig, run: RunConfig) -> PlanConfig:
    """`plan` with the tasks the run's settings need (see the module docstring)."""
    writers = [name for name, task in plan.tasks.items() if any(_slot_name(s) == GLOBAL_TOKENS for s in task.writes)]
    if run.model.loss_normalization == "local":
        if writers:
            raise ConfigError(
                ConfigProblem(
                    f"pipeline.tasks.{writers[0]}",
                    f"writes '{GLOBAL_TOKENS}' (global-token loss normalisation) but model.loss_normalization=local; "
                    "set model.loss_normalization=global_tokens or remove the task",
                )
            )
        return plan
    if writers:  # the plan places the all-reduce itself
        return plan
    forwards = [name for name, task in plan.tasks.items() if task.fn == f"{_TASKS}.forward"]
    if not forwards:
        raise ConfigError(
            ConfigProblem("model.loss_normalization", f"global_tokens needs a task running {_TASKS}.forward")
        )
    tasks: dict[str, TaskConfig] = {}
    for name, task in plan.tasks.items():
        if name == forwards[0]:
            tasks[GLOBAL_TOKENS_TASK] = TaskConfig(
                fn=f"{_TASKS}.{GLOBAL_TOKENS_TASK}",
                reads=[BATCH_GPU],
                writes=[GLOBAL_TOKENS],
                nccl=True,
                thread=task.thread,
            )
            task = task.model_copy(update={"reads": [*task.reads, GLOBAL_TOKENS]})
        tasks[name] = task
    return plan.model_copy(update={"tasks": tasks})


def training_plan(run: RunConfig, resolve_fn: ResolveFn | None = None) -> CompiledPlan:
    """Derive and compile `run.pipeline`; ConfigError (with config paths) if it cannot train this run.

    With the default `resolve_fn` (the task code is imported) this also checks that a model with
    torchrec tables can import torchrec here."""
    if resolve_fn is None and isinstance(run.model, ShardedModelConfig):
        _require_torchrec(run)
    plan = compile_plan(derive_plan(run.pipeline, run), resolve_fn=resolve_fn)
    prefetching = sorted(name for name, fn in plan.fn_paths().items() if fn in PREFETCH_FNS)
    if prefetching and plan.config.torchrec_context != "prefetch":
        raise ConfigError(
            ConfigProblem(
                "pipeline.torchrec_context",
                f"task(s) {', '.join(prefetching)} prefetch embeddings, which needs torchrec's prefetch "
                "context; set pipeline.torchrec_context=prefetch",
            )
        )
    return plan


def _require_torchrec(run: RunConfig) -> None:
    try:
        importlib.import_module("torchrec.distributed.model_parallel")
    except ImportError as exc:
        path = "model.name" if run.model.name else "model.builder"
        raise ConfigError(
            ConfigProblem(
                path,
                f"model '{run.model.label}' has torchrec tables (a ShardedModelConfig), but torchrec cannot be "
                f"imported here ({exc}); a model with plain torch tables, such as model=dlrm_torch, trains without it",
            )
        ) from None


def idle_tasks(plan: CompiledPlan, run: RunConfig) -> dict[str, str]:
    """Tasks of `plan` that have nothing to do for `run.model` and `run.trainer.dense_ddp`, with the reason."""
    idle = {}
    for name, fn in plan.fn_paths().items():
        if fn in INPUT_DIST_FNS and not isinstance(run.model, ShardedModelConfig):
            idle[name] = "the model has no torchrec-sharded tables: no input to distribute"
        elif fn == FINALIZE_FN and run.trainer.dense_ddp == "torch":
            idle[name] = "torch DDP all-reduces the gradients during backward (trainer.dense_ddp=megatron uses it)"
    return idle


def _slot_name(slot: str | tuple[str, int]) -> str:
    return slot if isinstance(slot, str) else slot[0]
