"""Pipeline-parallel training: a model split into stages over ranks, run by the engine.

Each rank runs its stages (`StageRuntime`: forward F, input gradient B, weight gradient W, and
the point-to-point transfers) in the order of its action list, one engine plan per step
(`ActionOrderRunner`), whatever the schedule: GPipe, 1F1B, ZB-H1 and ZB-H2 are declared as
lookaheads and compiled to action lists, interleaved 1F1B, ZBV and DualPipeV come as action
lists, and so does a torch CSV (`recsys_pipe.pp_schedules`, `resolve_schedule`). Dropout sites
keyed by (step, microbatch, layer) (`recsys_pipe.models.dropout.seeded_dropout`; the runtime
sets the key, `microbatch_seed`) draw the same masks wherever they run, so a pipelined run
equals the one-rank run. Each model cuts itself into stages (`ModelConfig.stage_split`).
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
    "MLPStage": "mlp",
    "TorchStageAdapter": "mlp",
    "mlp_stages": "mlp",
    "PipelinedModel": "train",
    "build_pipelined_model": "train",
    "PeerLink": "p2p",
    "PipelineMesh": "mesh",
    "NAMED_SCHEDULES": "schedules",
    "ResolvedSchedule": "schedules",
    "resolve_schedule": "schedules",
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
