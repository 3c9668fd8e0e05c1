"""The plan a training run executes: `run.pipeline`, compiled once and checked against the adapter.

Both CLIs call `training_plan(run)`, so `recsys-plan` shows exactly what `recsys-train` runs,
and the trainer receives the compiled object instead of compiling again.
"""

from __future__ import annotations

from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem, compile_plan
from recsys_pipe.config.resolve import ResolveFn
from recsys_pipe.train.config import RunConfig

__all__ = ["training_plan"]

#: task functions that need torchrec's prefetch context (`pipeline.torchrec_context: prefetch`)
PREFETCH_FNS = frozenset({"recsys_pipe.train.tasks.prefetch_embeddings"})


def training_plan(run: RunConfig, resolve_fn: ResolveFn | None = None) -> CompiledPlan:
    """Compile `run.pipeline`; ConfigError (with config paths) if it cannot train this run."""
    plan = compile_plan(run.pipeline, resolve_fn=resolve_fn)
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
