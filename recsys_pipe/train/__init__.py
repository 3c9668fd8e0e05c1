"""Training adapter: the run config, the task functions, their shared state, the loop.

It names its task modules to the task registry (`TASK_MODULES`), so a plan's `fn: h2d` finds
the shipped tasks once this package is imported.

Names are imported on first use (PEP 562): `import recsys_pipe.train` loads no torchrec, and
nothing in the training path imports it unless the model has torchrec tables. The process
plumbing around the loop (process group, run directory, peer health, preemption) is
`recsys_pipe.runtime`.
"""

from __future__ import annotations

from recsys_pipe._lazy import lazy_exports
from recsys_pipe.config.task_registry import TASKS

#: the modules of the shipped task functions (`@task`): this package names them to the registry,
#: which imports them on the first lookup of a name (`fn: h2d`); a new module of shipped tasks is
#: added here
TASK_MODULES = ("recsys_pipe.train.tasks", "recsys_pipe.train.lookup_tasks")
TASKS.add_modules(*TASK_MODULES)

_EXPORTS = {
    "CheckpointConfig": "checkpoint",
    "Checkpointer": "checkpoint",
    "find_checkpoints": "checkpoint",
    "resolve_resume": "checkpoint",
    "MetricsWriter": "metrics",
    "RetrievalEvaluation": "retrieval_eval",
    "retrieval_metrics": "retrieval_eval",
    "LrSchedule": "optim",
    "TrainOptimizer": "optim",
    "RngState": "rng",
    "RunConfig": "config",
    "TrainerConfig": "config",
    "load_run_config": "config",
    "MegatronGrads": "dense_ddp",
    "check_dense_ddp": "dense_ddp",
    "megatron_ddp": "dense_ddp",
    "OPTIMIZERS": "optim",
    "OptimizerConfig": "optim",
    "SparseOptimizerConfig": "optim",
    "local_parameters": "params",
    "MemoryEstimate": "memory",
    "dry_run_tables": "memory",
    "estimate_memory": "memory",
    "training_plan": "plan",
    "BatchBalancer": "shuffle",
    "karmarkar_karp": "shuffle",
    "GradBuffers": "state",
    "TrainState": "state",
    "StepResult": "tasks",
    "build_model": "build",
    "build_state": "build",
    "Trainer": "trainer",
    "TrainSummary": "progress",
    "RunPosition": "progress",
    "RunCheckpointer": "resume",
    "Reporter": "reporting",
    "build_plan_runner": "build",
    "build_parts": "build",
    "TrainParts": "build",
    "Evaluator": "evaluation",
    "CompileOptions": "torch_compile",
    "CompiledDense": "torch_compile",
    "compile_dense": "torch_compile",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
