"""How a run spreads its model over the ranks, chosen once, in the build phase, from the config.

One seam, three implementations (`Parallelism`):

- `Replicated`: a model with plain torch tables, replicated on every rank under DDP (torch's or
  megatron-core's, `trainer.dense_ddp`);
- `ShardedTables`: a model with torchrec tables, sharded over the ranks by
  `DistributedModelParallel` (`model.sharding`), its dense part under DDP;
- `PipelineStages`: the model's layers cut into stages over ranks (`parallel.pp`), each stage's
  replicas data-parallel.

Each implementation owns what differs between them: its checks before any process group
starts, the data share of a rank, the model build, the loss averaged over data-parallel
replicas, the optimizer-state layout of checkpoints, the text `recsys-plan` shows and the
profiler's extra files. Nothing outside this package asks which one a run uses.

Names are imported on first use (PEP 562): the config section (`ParallelConfig`) is loaded with
every run config, the implementations only when a run is built.
"""

from __future__ import annotations

from recsys_pipe._lazy import lazy_exports

_EXPORTS = {
    "ParallelConfig": "config",
    "Parallelism": "base",
    "parallelism_of": "choice",
    "Replicated": "replicated",
    "ShardedTables": "sharded",
    "PipelineStages": "stages",
    "Topology": "topology",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
