"""The `parallel` section of the run config: how the model is spread over ranks beyond data
parallelism. Each kind owns its own section (`parallel.pp`: `recsys_pipe.pp.config`)."""

from __future__ import annotations

from pydantic import Field

from recsys_pipe.config import Section
from recsys_pipe.pp.config import PipelineParallelConfig

__all__ = ["ParallelConfig"]


class ParallelConfig(Section):
    """How the model is spread over ranks (`parallel.*`)."""

    pp: PipelineParallelConfig = Field(
        default_factory=PipelineParallelConfig, description="pipeline parallelism: the model's layers split into stages"
    )
