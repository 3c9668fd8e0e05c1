"""`recsys-train` with `parallel.pp`: the model split into stages over ranks, as one module.

`PipelinedModel` stands where the model stands in the batch-level plan: the plan's `forward`
task calls it on a batch, and one call runs the whole pipelined step of this rank (the
microbatches' F, B and W under the rank's schedule, the transfers, the gradients scaled by 1/m
and, but the sharded tables', averaged over the stage's data-parallel replicas). It returns the
step's loss (the mean of the last stage's microbatch losses, broadcast over the pipeline so
every rank logs it) as a leaf, so the plan's `backward` task has nothing left to do;
`optimizer_step` then steps this rank's stages. The batch-level plan is unchanged: h2d,
input dist and friends still prepare the next batches ahead.

Each rank builds the whole model from the run's seed (the same initial weights everywhere),
keeps its stages and registers only those, so its parameters, optimizer and checkpoint hold
its stages alone. The first stage's ranks shard the model's torchrec tables with
`DistributedModelParallel` over their data-parallel group (`shard_tables`: `model.sharding`,
one rank's group without data parallelism), always on torchrec's dense kernel: the tables'
gradients add up over the microbatches and the dense optimizer steps them once per step, with
the other weights, whatever the schedule. Each table's lookup runs its all-to-alls inside the
stage's forward and backward, which every replica's schedule runs in the same order. Its
gradient arrives summed over the replicas, as in an unpipelined run (torchrec's backward
all-to-all adds every rank's gradient of the rows; DDP averages only the dense weights), so
the stage averages all but the tables' (`StageRuntime.summed_params`). A checkpoint holds the
tables and their optimizer state (e.g. Adam's moments) as `ShardedTensor`s laid out like the tables.

In evaluation mode a call runs the batch forward through the stages. HSTU ranking: the last
stage keeps the logits and labels the metrics read (the other ranks add none). The retrieval
models: the last stage ranks each user's held-out item and broadcasts the ranks over the
pipeline, so every rank holds its replica's users (`RetrievalEvaluation` gathers one rank per
replica). Not yet: gradient clipping across stages, global-token loss normalisation, gradient accumulation, bf16;
`recsys_pipe.pp.config.check_training` refuses them (exit 2) before any process group starts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recsys_pipe.engine import SpanRecorder
from recsys_pipe.pp.actions import ActionOrderRunner
from recsys_pipe.pp.config import pipelined_tables, split_layers
from recsys_pipe.pp.mesh import PipelineMesh
from recsys_pipe.pp.p2p import PeerLink
from recsys_pipe.pp.stage import StageRuntime, as_stage_input
from recsys_pipe.pp.timeline import compute_spans, gather_spans, transfer_time

__all__ = ["PipelinedModel", "build_pipelined_model", "shard_tables"]


class PipelinedModel(nn.Module):
    """This rank's stages of the model and the runner of its schedule; `forward(batch)` runs one
    pipelined step (see the module docstring) and returns `(loss, outputs)` like the model."""

    def __init__(self, stages: dict[int, nn.Module], runner: Any, mesh: PipelineMesh, last_rank: int, m: int):
        super().__init__()
        self.stages = nn.ModuleDict({str(s): module for s, module in sorted(stages.items())})
        self.runner, self.mesh, self.last_rank, self.microbatches = runner, mesh, last_rank, m
        #: the optimizer steps taken (the dropout key's step), saved with the stages' weights
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        #: with `record_timelines()`: this rank's compute spans of the last step
        self.last_spans: list | None = None
        self._recording = False

    def record_timelines(self) -> None:
        """From the next step on, keep each step's F / B / W spans (`last_spans`)."""
        self._recording = True

    def gathered_spans(self) -> list:
        """Every rank's spans of the pipeline's last recorded step, indexed by pipeline rank (a
        collective over the pipeline's ranks)."""
        return gather_spans(self.last_spans or [], group=self.mesh.mesh.get_group("pp"))

    def transfer_ms(self) -> float:
        """One stage message between pipeline ranks 0 and 1 of this replica, one way (ms;
        `transfer_time`: rank 0 sends one like its last, rank 1 echoes it; the other ranks
        measure nothing and return 0). Every rank of the pipeline calls it."""
        if self.mesh.pp_rank > 1:
            return 0.0
        link = next(iter(self._runtimes().values())).link
        if self.mesh.pp_rank == 1:
            return transfer_time(link, self.mesh.rank_of(0)) * 1e3
        message = tuple(torch.zeros(shape, dtype=dtype).requires_grad_(grad) for shape, dtype, grad in link.last_sent)
        return transfer_time(link, self.mesh.rank_of(1), message) * 1e3

    def replica_mean(self, value: torch.Tensor) -> float:
        """A value every rank of a pipeline holds alike (the step's loss), averaged over the
        data-parallel replicas (as a one-stage run over the same replicas averages it)."""
        value = value.detach().float().reshape(1).clone()
        group = self.mesh.dp_group
        if group is not None:
            dist.all_reduce(value, group=group)
            value /= self.mesh.dp_size
        return float(value)

    def _runtimes(self) -> dict[int, StageRuntime]:
        return self.runner.runtimes

    def _evaluate(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward only, the whole batch at once, stage after stage (a rank's stages in order;
        sends are asynchronous, so a V layout's rank waits for the stages between its two)."""
        runtimes = self._runtimes()
        outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        loss = torch.zeros(())
        with torch.no_grad():
            for s, runtime in sorted(runtimes.items()):
                if runtime.is_first:
                    inputs: tuple[torch.Tensor, ...] = ()
                elif s - 1 in outputs:
                    inputs = as_stage_input(outputs[s - 1])
                else:
                    inputs = runtime.recv_activation(0)
                record = runtime.forward(0, batch, inputs)
                outputs[s] = record.outputs
                if runtime.is_last:
                    loss = record.loss
                elif s + 1 not in runtimes:
                    runtime.send_activation(record)
        link = next(iter(runtimes.values())).link
        if link is not None:
            link.wait_sends()
        last = max(runtimes)
        shared = runtimes[last].module.shared_eval_outputs
        if runtimes[last].is_last:
            result = dict(runtimes[last].module.last_outputs)
        else:  # no scores here; a retrieval model's ranks are filled by the broadcast below
            empty = torch.zeros(0, 1 if shared else batch.labels.shape[1])
            result = {"logits": empty, "labels": empty}
            result.update({key: torch.empty(batch.sample_ids.shape[0], dtype=torch.int64) for key in shared})
        if self.mesh.pp_size > 1:
            group = self.mesh.mesh.get_group("pp")
            dist.broadcast(loss, self.last_rank, group=group)
            for key in shared:  # a retrieval model's ranks: every rank of the pipeline gets its users'
                dist.broadcast(result[key], self.last_rank, group=group)
        return loss, result

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if not self.training:
            return self._evaluate(batch)
        size, m = batch.sample_ids.shape[0], self.microbatches
        microbatches = [batch.select(torch.arange(j * size // m, (j + 1) * size // m)) for j in range(m)]
        recorder = SpanRecorder() if self._recording else None
        self.runner.plan_runner.observer = recorder
        losses = self.runner.run_step(int(self.step), microbatches)
        self.step += 1
        if recorder is not None:
            self.last_spans = compute_spans(recorder.spans(), self.mesh.pp_rank)
        mine = [v for v in losses if v is not None]
        loss = torch.stack(mine).mean() if mine else torch.zeros(())
        if self.mesh.pp_size > 1:  # every rank of the pipeline logs the step's loss
            dist.broadcast(loss, self.last_rank, group=self.mesh.mesh.get_group("pp"))
        empty = torch.zeros(0, 1)
        return loss.requires_grad_(), {"logits": empty, "labels": empty}


def build_pipelined_model(run: Any, info: Any, spec: Any) -> PipelinedModel:
    """The model split over the `parallel.pp` mesh: this rank's stages, cut as the model's config
    declares (`ModelConfig.stage_split`)."""
    pp = run.parallel.pp
    resolved = pp.resolved()
    mesh = PipelineMesh.create(pp.size, info.device.type)
    torch.manual_seed(run.seed)
    model = run.model.build(spec).to(info.device)
    local = resolved.local_stages(mesh.pp_rank)
    tables: list[nn.Parameter] = []
    if 0 in local:  # the first stage's ranks: its tables sharded over their data-parallel group
        tables = shard_tables(model, run, mesh, info.device)
    split = [list(r) for r in split_layers(run.model.stage_layers, resolved.num_stages, pp.layers)]
    modules = run.model.cut_into_stages(model, split)
    ranks = [mesh.rank_of(r) for r in resolved.ranks_of_stages]
    link = PeerLink()
    n = len(modules)
    runtimes = {
        s: StageRuntime(
            modules[s],
            s,
            n,
            prev_rank=ranks[s - 1] if s > 0 else None,
            next_rank=ranks[s + 1] if s < n - 1 else None,
            link=link,
            seed=run.seed,
            dp_group=mesh.dp_group,
            summed_params=tables if s == 0 else (),
        )
        for s in local
    }
    m = resolved.microbatches
    runner = ActionOrderRunner(runtimes, resolved.actions, mesh.pp_rank, resolved.ranks_of_stages, m, link=link)
    return PipelinedModel({s: modules[s] for s in local}, runner, mesh, ranks[-1], m)


def shard_tables(model: nn.Module, run: Any, mesh: PipelineMesh, device: torch.device) -> list[nn.Parameter]:
    """Shard `model`'s torchrec tables in place with `DistributedModelParallel` over the first
    stage's data-parallel group (`mesh.table_group`; collective over it), as `model.sharding`
    lays them out, on torchrec's dense kernel, without DMP's DDP (the stage averages its dense
    gradients itself). Returns the tables' parameters: their gradients arrive summed over the
    group (torchrec's backward all-to-all), so the stage does not average them again.

    Dense, whatever `model.compute_kernel` says: a step runs m microbatch backwards and one
    optimizer step, and the fused kernel would update the rows inside each backward, in an order
    that depends on the schedule; the dense kernel lets the gradients add up over the
    microbatches and the dense optimizer update the tables once, with the other weights."""
    from torchrec.distributed.types import ShardedModule

    from recsys_pipe.models.sharding import make_sharded_model

    cfg = pipelined_tables(run.model)
    sharded = make_sharded_model(
        model, cfg, mesh.table_group, device, batch_size=run.data.batch_size, data_parallel=False
    ).module
    return [p for m in sharded.modules() if isinstance(m, ShardedModule) for p in m.parameters()]
