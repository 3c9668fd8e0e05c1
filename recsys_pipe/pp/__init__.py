"""Pipeline-parallel training: a model split into stages over ranks, run by the engine.

Each rank runs one stage (`StageRuntime`: forward F, input gradient B, weight gradient W, and
the point-to-point transfers) under an engine plan over the step's microbatches
(`stage_plan` / `stage_schedule`: GPipe, 1F1B, ZB-H1, ZB-H2 as lookaheads). `SeededDropout`
draws masks keyed by (step, microbatch, layer), so a pipelined run equals the one-rank run.
"""

from recsys_pipe.pp.dropout import SeededDropout, current_microbatch_seed, microbatch_seed
from recsys_pipe.pp.p2p import PeerLink
from recsys_pipe.pp.plan import SCHEDULES, StagePlan, stage_plan, stage_schedule, stage_tasks
from recsys_pipe.pp.runner import StageStepRunner
from recsys_pipe.pp.stage import BackwardRecord, ChainedStages, ForwardRecord, StageRuntime

__all__ = [
    "SCHEDULES",
    "BackwardRecord",
    "ChainedStages",
    "ForwardRecord",
    "PeerLink",
    "SeededDropout",
    "StagePlan",
    "StageRuntime",
    "StageStepRunner",
    "current_microbatch_seed",
    "microbatch_seed",
    "stage_plan",
    "stage_schedule",
    "stage_tasks",
]
