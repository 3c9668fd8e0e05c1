"""One optimizer step's microbatches through a rank's stage, driven by the engine.

The rank's plan (`recsys_pipe.pp.plan`) is compiled once into a `SchedulablePipeline` whose
batches are microbatches. Each step feeds it a fresh iterator over the step's microbatches and
runs it until every microbatch is drained (fill, steady state, cool-down), then completes the
posted sends and scales the summed gradients by 1/m. The step's receives (every microbatch's
activation from the previous stage, gradient from the next) are posted before it starts, so
a neighbour's send finds them posted (see `recsys_pipe.pp.p2p`). The optimizer step itself stays with the
caller (the batch-level plan), so a pipelined step slots in where forward + backward were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from recsys_pipe.engine import SchedulablePipeline, TaskObserver
from recsys_pipe.pp.plan import StagePlan, stage_schedule
from recsys_pipe.pp.stage import StageRuntime

__all__ = ["StageStepRunner"]


class StageStepRunner:
    """Runs `plan` for `runtime`'s stage, one optimizer step per `run_step` call."""

    def __init__(
        self,
        runtime: StageRuntime,
        plan: StagePlan,
        *,
        executor: str = "sequential",
        observer: TaskObserver | None = None,
    ):
        if (plan.stage, plan.num_stages) != (runtime.stage, runtime.num_stages):
            raise ValueError(
                f"plan is for stage {plan.stage} of {plan.num_stages}, "
                f"runtime runs {runtime.stage} of {runtime.num_stages}"
            )
        self.runtime = runtime
        self.plan = plan
        self.pipeline = SchedulablePipeline(stage_schedule(plan), executor=executor, state=runtime, observer=observer)

    def run_step(self, step: int, microbatches: Sequence[Any]) -> list[torch.Tensor | None]:
        """Forward and backward of every microbatch of optimizer step `step`; returns the
        microbatches' losses in order (the last stage's; None on the other stages). The
        parameters' `.grad` then hold the mean over the microbatches (and the data-parallel
        replicas) of their gradients."""
        if len(microbatches) != self.plan.microbatches:
            raise ValueError(f"the plan is for {self.plan.microbatches} microbatches, got {len(microbatches)}")
        self.runtime.begin_step(step, len(microbatches))
        for j in range(len(microbatches)):
            if not self.runtime.is_first:
                self.runtime.post_recv_activation(j)
            if not self.runtime.is_last:
                self.runtime.post_recv_gradient(j)
        losses = list(self.pipeline.iterate(iter(microbatches)))
        if self.runtime.link is not None:
            self.runtime.link.wait_sends()
        self.runtime.end_step(len(microbatches))
        return losses

    def shutdown(self) -> None:
        """Stop the engine pipeline's worker threads."""
        self.pipeline.shutdown()
