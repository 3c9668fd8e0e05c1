"""The plan a training run executes: `run.pipeline`, derived for the run's settings, compiled once.

Both CLIs call `training_plan(run)`, so `recsys-plan` shows exactly what `recsys-train` runs,
and the trainer receives the compiled object instead of compiling again.

Derivation: a setting that needs extra work per step adds its task to whatever plan was chosen,
instead of every plan file carrying it. `model.loss_normalization=global_tokens` adds
`global_tokens_allreduce` (the loss-token count summed over ranks) before `forward`, which reads
it; with the default `local` normalisation no plan issues that collective.

On the CPU, a plan that prefetches embeddings (`prefetch_embeddings`, torchrec's prefetch
layout) runs `wait_input_dist` after forward and `prefetch_embeddings` after backward
(`cpu_prefetch_layout`): there is no embedding cache to warm, and the layout's point on a GPU,
the next batch's tensors all-to-all running during forward, on the CPU means gloo's thread
taking a core from the forward (measured: forward 4.9 against 4.1 ms at batch 32 on two
cores). The losses are the same bits either way.

What a task needs from the run is declared where it is registered (`@task(..., needs=...)`,
`recsys_pipe.config.task_registry.Need`), and the builder asks the plan's tasks: a task that
needs torchrec's prefetch context requires `pipeline.torchrec_context: prefetch`; `idle_tasks`
names the tasks that have nothing to do because the run cannot give them what they need (the
input-dist tasks of a model without torchrec tables, finalize_model_grads under torch DDP), for
`recsys-plan` to say so.
"""

from __future__ import annotations

import importlib

from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem, PlanConfig, TaskConfig, compile_plan
from recsys_pipe.config.resolve import ResolveFn, import_fn
from recsys_pipe.config.task_registry import TASKS, Need, TaskSpec, is_task_name
from recsys_pipe.models.base import ShardedModelConfig
from recsys_pipe.train import lookup_tasks, tasks
from recsys_pipe.train.config import RunConfig
from recsys_pipe.train.slots import BATCH_GPU, GLOBAL_TOKENS

__all__ = [
    "cpu_prefetch_layout",
    "derive_plan",
    "idle_tasks",
    "pipelining_without_effect",
    "planned_device_type",
    "training_plan",
]


def derive_plan(plan: PlanConfig, run: RunConfig, resolve_fn: ResolveFn | None = None) -> PlanConfig:
    """`plan` with the tasks the run's settings need, laid out for its device (see the module
    docstring).

    The forward task is the one running the registered `forward` (by name, or by an import path
    when `resolve_fn` imports it: the default)."""
    if planned_device_type(run.trainer.device) == "cpu":
        plan = cpu_prefetch_layout(plan, resolve_fn)
    return _with_global_tokens(plan, run, resolve_fn)


def planned_device_type(device: str) -> str:
    """The device type a run of `trainer.device` is planned for: auto meaning CUDA if visible
    (a plan for cuda can be shown on a machine without one)."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def cpu_prefetch_layout(plan: PlanConfig, resolve_fn: ResolveFn | None = None) -> PlanConfig:
    """`plan` with the CPU's prefetch layout (see the module docstring): its input-dist wait after
    the iteration's forward, its embedding prefetch after the iteration's backward. A plan
    without exactly one task of each of the four is returned as it is."""
    registered = {
        kind: TASKS.spec_of(fn)
        for kind, fn in (
            ("prefetch", tasks.prefetch_embeddings),
            ("wait", tasks.wait_input_dist),
            ("forward", tasks.forward),
            ("backward", tasks.backward),
        )
    }
    names: dict[str, list[str]] = {kind: [] for kind in registered}
    for name, task in plan.tasks.items():
        spec = _spec(task, resolve_fn)
        for kind, wanted in registered.items():
            if spec is not None and spec is wanted:
                names[kind].append(name)
    if any(len(found) != 1 for found in names.values()):
        return plan
    prefetch, wait, forward, backward = (names[k][0] for k in ("prefetch", "wait", "forward", "backward"))
    derived = dict(plan.tasks)
    derived[wait] = derived[wait].model_copy(update={"same_progress_sync": [forward]})
    derived[prefetch] = derived[prefetch].model_copy(update={"same_progress_sync": [backward]})
    after = [t for t in derived[backward].same_progress_sync if t != prefetch]
    derived[backward] = derived[backward].model_copy(update={"same_progress_sync": after})
    return plan.model_copy(update={"tasks": derived})


def _with_global_tokens(plan: PlanConfig, run: RunConfig, resolve_fn: ResolveFn | None) -> PlanConfig:
    """`plan` with `global_tokens_allreduce` when `model.loss_normalization=global_tokens`."""
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
    forward, allreduce = TASKS.spec_of(tasks.forward), TASKS.spec_of(tasks.global_tokens_allreduce)
    assert forward is not None and allreduce is not None  # registered where they are defined
    forwards = [name for name, task in plan.tasks.items() if _spec(task, resolve_fn) is forward]
    if not forwards:
        raise ConfigError(
            ConfigProblem(
                "model.loss_normalization", f"global_tokens needs a task running {forward.name} (fn: {forward.name})"
            )
        )
    derived: dict[str, TaskConfig] = {}
    for name, task in plan.tasks.items():
        if name == forwards[0]:
            derived[allreduce.name] = TaskConfig(
                fn=allreduce.name, reads=[BATCH_GPU], writes=[GLOBAL_TOKENS], nccl=True, thread=task.thread
            )
            task = task.model_copy(update={"reads": [*task.reads, GLOBAL_TOKENS]})
        derived[name] = task
    return plan.model_copy(update={"tasks": derived})


def _spec(task: TaskConfig, resolve_fn: ResolveFn | None) -> TaskSpec | None:
    """The registry entry of a task's `fn`, if it names a registered function (unknown names and
    paths that cannot be resolved are left to the compiler, which reports them)."""
    try:
        if is_task_name(task.fn):
            return TASKS.lookup(task.fn)
        if resolve_fn is None:
            return TASKS.spec_of(import_fn(task.fn))
    except Exception:  # an unknown name or a bad path: compile_plan reports it at the task's fn
        return None
    return None


def training_plan(run: RunConfig, resolve_fn: ResolveFn | None = None) -> CompiledPlan:
    """Derive and compile `run.pipeline` for this run.

    Deriving adds the tasks the run's settings need (e.g. `global_tokens_allreduce` with
    `model.loss_normalization=global_tokens`). With the default `resolve_fn` (the task code is
    imported) this also checks that a model with torchrec tables can import torchrec here.

    Args:
        run: the validated run config.
        resolve_fn: how task functions are found (see `compile_plan`); `structure_only` compiles
            without importing task code.

    Returns:
        The `CompiledPlan`. Raises ConfigError (with config paths) if it cannot train this run."""
    if resolve_fn is None and isinstance(run.model, ShardedModelConfig):
        _require_torchrec(run)
    plan = compile_plan(derive_plan(run.pipeline, run, resolve_fn), resolve_fn=resolve_fn)
    prefetching = sorted(plan.needing(Need.PREFETCH_CONTEXT))
    if prefetching and plan.config.torchrec_context != "prefetch":
        raise ConfigError(
            ConfigProblem(
                "pipeline.torchrec_context",
                f"task(s) {', '.join(prefetching)} prefetch embeddings, which needs torchrec's prefetch "
                "context; set pipeline.torchrec_context=prefetch",
            )
        )
    lookups = TASKS.spec_of(lookup_tasks.start_embedding_lookup)
    options = {t.name: t.options for t in plan.order if plan.specs.get(t.name) is lookups}
    problems = lookup_tasks.lookup_coverage_problems(
        {name: o if o is not None else lookup_tasks.LookupOptions() for name, o in options.items()}
    )
    if problems:
        raise ConfigError(problems)
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


#: Needs the run may be unable to meet, with the reason a task needing one then has nothing to do.
_IDLE_WITHOUT = {
    Need.SPARSE_DIST: "the model has no torchrec-sharded tables: no input to distribute",
    Need.GRAD_BUFFERS: "torch DDP all-reduces the gradients during backward (trainer.dense_ddp=megatron uses it)",
}


def _provides(run: RunConfig, need: Need) -> bool:
    """Whether `run` gives its tasks `need` (the state `build_state` makes for it)."""
    if need is Need.SPARSE_DIST:
        return isinstance(run.model, ShardedModelConfig)
    if need is Need.GRAD_BUFFERS:
        return run.trainer.dense_ddp == "megatron"
    return True  # built on demand (BALANCER) or checked by training_plan (PREFETCH_CONTEXT)


def idle_tasks(plan: CompiledPlan, run: RunConfig) -> dict[str, str]:
    """Tasks of `plan` that have nothing to do for `run.model` and `run.trainer.dense_ddp`, with the reason."""
    idle = {}
    for task in plan.order:
        needs = plan.specs[task.name].needs if task.name in plan.specs else frozenset()
        missing = [need for need in _IDLE_WITHOUT if need in needs and not _provides(run, need)]
        if missing:
            idle[task.name] = _IDLE_WITHOUT[missing[0]]
    return idle


def pipelining_without_effect(plan: CompiledPlan, run: RunConfig) -> str | None:
    """A one-line warning when the plan pipelines work the model does not have: a plan that runs
    torchrec's input distribution or lookup ahead (lookahead > 0) or uses a torchrec context, for
    a model without torchrec tables (e.g. `model=dlrm_torch`): those tasks do nothing and the run
    trains as the serial plan does. A warning, not an error: the run is correct, only not what
    the plan's name promises. None when the plan has its effect."""
    if _provides(run, Need.SPARSE_DIST):
        return None
    idle = idle_tasks(plan, run)
    ahead = [t.name for t in plan.order if t.name in idle and t.lookahead > 0]
    if not ahead and plan.config.torchrec_context == "base":
        return None
    what = f"runs {', '.join(ahead)} ahead" if ahead else f"uses torchrec's {plan.config.torchrec_context} context"
    return (
        f"pipeline={plan.config.name} {what}, but model '{run.model.label}' has no torchrec tables: those tasks have "
        "nothing to do and this run trains as pipeline=serial would"
    )


def _slot_name(slot: str | tuple[str, int]) -> str:
    return slot if isinstance(slot, str) else slot[0]
