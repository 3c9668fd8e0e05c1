"""Which `Parallelism` a run uses: decided once, from its config, in the build phase."""

from __future__ import annotations

from typing import TYPE_CHECKING

from recsys_pipe.models.base import ShardedModelConfig

if TYPE_CHECKING:
    from recsys_pipe.train.config import RunConfig
    from recsys_pipe.train.parallel.base import Parallelism

__all__ = ["parallelism_of"]


def parallelism_of(run: RunConfig) -> Parallelism:
    """Pipeline stages when `parallel.pp` asks for them, else by the model's config class:
    torchrec tables are sharded, plain torch tables replicated."""
    if run.parallel.pp.enabled:
        from recsys_pipe.train.parallel.stages import PipelineStages

        return PipelineStages(run)
    if isinstance(run.model, ShardedModelConfig):
        from recsys_pipe.train.parallel.sharded import ShardedTables

        return ShardedTables(run)
    from recsys_pipe.train.parallel.replicated import Replicated

    return Replicated(run)
