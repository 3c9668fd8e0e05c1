"""The per-rank text `recsys-plan` shows for `parallel.pp` (`PipelineStages.describe_steps`):
what each rank runs in one step, and its bubble simulated with unit times."""

from __future__ import annotations

from recsys_pipe.autosched.pipeline_parallel import simulate
from recsys_pipe.pp.config import PipelineParallelConfig
from recsys_pipe.pp_schedules.lookahead import stage_plan, task_lookaheads

__all__ = ["render_pipeline_parallel"]


def render_pipeline_parallel(pp: PipelineParallelConfig) -> str:
    """Each rank's stages and plan (tasks and lookaheads, or its static action order), the
    order it runs one step's microbatches in, and the simulated bubble with unit F/B/W times."""
    resolved = pp.resolved()
    size, m = pp.size, resolved.microbatches
    out = [
        f"pipeline parallelism: {resolved.name}, {size} rank(s), {resolved.num_stages} stage(s), "
        f"{m} microbatches per step (each data.batch_size / {m} samples)"
    ]
    if resolved.lookaheads:
        out.append("each rank's stage is declared as lookaheads over the step's microbatches, compiled to its order:")
    out.append("each rank runs its action list in order (one engine task per action, one iteration per step):")
    orders = resolved.compute_orders()
    for rank in range(size):
        stages = resolved.local_stages(rank)
        out.append("")
        out.append(f"rank {rank} (stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}):")
        if resolved.lookaheads:
            plan = stage_plan(resolved.name, size, rank, m)
            lookaheads = ", ".join(f"{name}@{k}" for name, k in task_lookaheads(plan))
            out.append(f"  tasks@lookahead: {lookaheads}  (ring: {plan.ring_slots} microbatch(es) in flight)")
        out.append(f"  order: {' '.join(map(str, orders.ranks[rank]))}")
    unit = simulate(orders, 1.0, 1.0, 1.0)
    out.append("")
    out.append(
        f"simulated with T_F = T_B = T_W = 1: makespan {unit.makespan:g}, bubble {unit.bubble:g}, "
        f"peak activations per rank {list(unit.peak_activations)}"
    )
    return "\n".join(out)
