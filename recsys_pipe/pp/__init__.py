"""Pipeline-parallel training: a model split into stages over ranks, run by the engine.

Each rank runs one stage (`StageRuntime`: forward F, input gradient B, weight gradient W, and
the point-to-point transfers) under an engine plan over the step's microbatches
(`stage_plan` / `stage_schedule`: GPipe, 1F1B, ZB-H1, ZB-H2 as lookaheads); schedules with
several stages per rank (interleaved 1F1B, ZBV, DualPipeV, a torch CSV) run as a static
per-rank action order on the engine (`ActionOrderRunner`). Dropout sites keyed by (step,
microbatch, layer) (`seeded_dropout`) draw the same masks wherever they run, so a pipelined run
equals the one-rank run.
`parallel.pp` is the config section (`PipelineParallelConfig`). The training loop reaches this
package through one door, `recsys_pipe.train.parallel.PipelineStages`; nothing here imports the
training package.

Names are imported on first use: loading the config must not import
torch.distributed.pipelining (seconds of start-up for every CLI).
"""

from recsys_pipe._lazy import lazy_exports

_EXPORTS = {
    "ActionOrderRunner": "actions",
    "Site": "actions",
    "action_schedule": "actions",
    "stage_ranks": "actions",
    "PipelineParallelConfig": "config",
    "check_pipeline_parallel": "config",
    "pipelined_tables": "config",
    "split_layers": "config",
    "MICROBATCH_DROPOUT": "dropout",
    "MicrobatchDropoutRng": "dropout",
    "current_microbatch_seed": "dropout",
    "microbatch_seed": "dropout",
    "seeded_dropout": "dropout",
    "MLPStage": "mlp",
    "TorchStageAdapter": "mlp",
    "mlp_stages": "mlp",
    "HSTUStage": "models",
    "hstu_stages": "models",
    "PipelinedModel": "train",
    "build_pipelined_model": "train",
    "PeerLink": "p2p",
    "PipelineMesh": "mesh",
    "SCHEDULES": "plan",
    "NAMED_SCHEDULES": "schedules",
    "ResolvedSchedule": "schedules",
    "resolve_schedule": "schedules",
    "StagePlan": "plan",
    "firing_order": "plan",
    "stage_plan": "plan",
    "stage_schedule": "plan",
    "stage_tasks": "plan",
    "StageStepRunner": "runner",
    "compute_spans": "timeline",
    "gather_spans": "timeline",
    "task_gaps": "timeline",
    "transfer_time": "timeline",
    "BackwardRecord": "stage",
    "ChainedStages": "stage",
    "ForwardRecord": "stage",
    "StageRuntime": "stage",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
