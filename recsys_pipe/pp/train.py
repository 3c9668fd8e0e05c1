"""`recsys-train` with `parallel.pp`: the model split into stages over ranks, as one module.

`PipelinedModel` stands where the model stands in the batch-level plan: the plan's `forward`
task calls it on a batch, and one call runs the whole pipelined step of this rank (the
microbatches' F, B and W under the rank's schedule, the transfers, the gradients scaled by 1/m
and averaged over the stage's data-parallel replicas). It returns the step's loss (the mean of
the last stage's microbatch losses, broadcast over the pipeline so every rank logs it) as a
leaf, so the plan's `backward` task has nothing left to do; `optimizer_step` then steps this
rank's stages. The batch-level plan is unchanged: h2d, input dist and friends still prepare the
next batches ahead.

Each rank builds the whole model from the run's seed (the same initial weights everywhere),
keeps its stages and registers only those, so its parameters, optimizer and checkpoint hold
its stages alone. The embedding tables are the first stage's plain torch parameters (not
sharded by torchrec: averaged over the first stage's replicas like any dense weight).

Not yet: evaluation through the stages, gradient clipping across stages, global-token loss
normalisation, gradient accumulation; `check_training` refuses them (exit 2) before any
process group starts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.pp.actions import ActionOrderRunner
from recsys_pipe.pp.config import split_layers
from recsys_pipe.pp.mesh import PipelineMesh
from recsys_pipe.pp.p2p import PeerLink
from recsys_pipe.pp.plan import stage_plan
from recsys_pipe.pp.runner import StageStepRunner
from recsys_pipe.pp.stage import StageRuntime

__all__ = ["PipelinedModel", "build_pipelined_model", "check_training", "is_pipelined"]


def is_pipelined(run: Any) -> bool:
    """Whether `run` trains through pipeline stages (several stages, or microbatches)."""
    pp = run.parallel.pp
    return pp.size > 1 or pp.num_microbatches > 1 or pp.resolved().num_stages > 1


def check_training(run: Any) -> None:
    """What a pipelined run cannot do yet; ConfigError naming the key."""
    cfg, problems = run.trainer, []
    if cfg.eval_every > 0 or cfg.eval_epochs > 0:
        problems.append(
            ConfigProblem(
                "trainer.eval_every",
                "evaluation through pipeline stages is not supported yet: set trainer.eval_every=0 "
                "trainer.eval_epochs=0 with parallel.pp",
            )
        )
    if run.optimizer.clip_grad_norm is not None:
        problems.append(
            ConfigProblem("optimizer.clip_grad_norm", "clipping over pipeline stages is not supported yet (use null)")
        )
    if getattr(run.model, "loss_normalization", "local") != "local":
        problems.append(ConfigProblem("model.loss_normalization", "only local with parallel.pp"))
    if cfg.grad_accumulation.enabled:
        problems.append(ConfigProblem("trainer.grad_accumulation.steps", "1 with parallel.pp (microbatches instead)"))
    if cfg.precision != "fp32":
        problems.append(ConfigProblem("trainer.precision", "fp32 with parallel.pp for now"))
    if problems:
        raise ConfigError(problems)


def _stage_modules(model: nn.Module, split: list[list[int]]) -> list[nn.Module]:
    """The model's stages, by its type (`recsys_pipe.pp.models`)."""
    from recsys_pipe.models.hstu import HSTUModel
    from recsys_pipe.pp.models import hstu_stages, sasrec_stages

    if isinstance(model, HSTUModel):
        return hstu_stages(model, split)
    return sasrec_stages(model, split)


class PipelinedModel(nn.Module):
    """This rank's stages of the model and the runner of its schedule; `forward(batch)` runs one
    pipelined step (see the module docstring) and returns `(loss, outputs)` like the model."""

    #: ranks hold different parameters: checkpoints key the optimizer's hyperparameters by
    #: parameter name (`recsys_pipe.train.optim`), so no rank's param groups override another's
    flat_optimizer_state = True

    def __init__(self, stages: dict[int, nn.Module], runner: Any, mesh: PipelineMesh, last_rank: int, m: int):
        super().__init__()
        self.stages = nn.ModuleDict({str(s): module for s, module in sorted(stages.items())})
        self.runner, self.mesh, self.last_rank, self.microbatches = runner, mesh, last_rank, m
        #: the optimizer steps taken (the dropout key's step), saved with the stages' weights
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))

    def replica_mean(self, value: torch.Tensor) -> float:
        """A value every rank of a pipeline holds alike (the step's loss), averaged over the
        data-parallel replicas (as a one-stage run over the same replicas averages it)."""
        value = value.detach().float().reshape(1).clone()
        group = self.mesh.dp_group
        if group is not None:
            dist.all_reduce(value, group=group)
            value /= self.mesh.dp_size
        return float(value)

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if not self.training:
            raise RuntimeError("evaluation through pipeline stages is not supported yet")
        size, m = batch.sample_ids.shape[0], self.microbatches
        microbatches = [batch.select(torch.arange(j * size // m, (j + 1) * size // m)) for j in range(m)]
        losses = self.runner.run_step(int(self.step), microbatches)
        self.step += 1
        mine = [v for v in losses if v is not None]
        loss = torch.stack(mine).mean() if mine else torch.zeros(())
        if self.mesh.pp_size > 1:  # every rank of the pipeline logs the step's loss
            dist.broadcast(loss, self.last_rank, group=self.mesh.mesh.get_group("pp"))
        empty = torch.zeros(0, 1)
        return loss.requires_grad_(), {"logits": empty, "labels": empty}


def build_pipelined_model(run: Any, info: Any, spec: Any) -> tuple[PipelinedModel, Any]:
    """The model split over the `parallel.pp` mesh and the dense optimizer of this rank's stages."""
    from recsys_pipe.train.optim import dense_optimizer_factory

    pp = run.parallel.pp
    resolved = pp.resolved()
    mesh = PipelineMesh.create(pp.size, info.device.type)
    torch.manual_seed(run.seed)
    model = run.model.build(spec).to(info.device)
    split = [list(r) for r in split_layers(_num_layers(run), resolved.num_stages, pp.layers)]
    modules = _stage_modules(model, split)
    ranks = [mesh.rank_of(r) for r in resolved.ranks_of_stages]
    local = resolved.local_stages(mesh.pp_rank)
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
        )
        for s in local
    }
    m = resolved.microbatches
    if resolved.actions is None:
        runner = StageStepRunner(runtimes[mesh.pp_rank], stage_plan(resolved.name, pp.size, mesh.pp_rank, m))
    else:
        runner = ActionOrderRunner(runtimes, resolved.actions, mesh.pp_rank, resolved.ranks_of_stages, m, link=link)
    pipelined = PipelinedModel({s: modules[s] for s in local}, runner, mesh, ranks[-1], m)
    return pipelined, dense_optimizer_factory(run.optimizer)(pipelined.parameters())


def _num_layers(run: Any) -> int:
    from recsys_pipe.pp.config import STAGEABLE_MODELS

    return getattr(run.model, STAGEABLE_MODELS[type(run.model)])
