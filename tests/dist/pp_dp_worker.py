"""Worker for test_pp_parity's pp x dp case: torchrun (gloo, CPU), 4 ranks = 2 stages x 2 replicas.

The MLP of pp_parity_worker trains 2 steps; each step's global batch is split over the 2
data-parallel replicas, each replica cuts its share into 4 microbatches and runs them through
its 2-rank pipeline (1F1B and ZB-H2 as engine plans; torch's ZBVZeroBubble order over 4 stages,
2 per rank, in the action-order mode); the stages' gradients are averaged over the replicas.
Rank 0 also computes the reference in one process: the whole model over each replica's share,
gradients averaged as the all-reduce does (each / 2, then summed).

Each rank saves `rank<r>.pt` as pp_parity_worker does, plus its mesh coordinates.
"""

import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from recsys_pipe.models.dropout import microbatch_seed
from recsys_pipe.pp import ChainedStages, PeerLink, StageRuntime
from recsys_pipe.pp.actions import ActionOrderRunner, stage_ranks
from recsys_pipe.pp.mesh import PipelineMesh
from recsys_pipe.pp.schedules import resolve_schedule
from recsys_pipe.pp_schedules.actions import PipelineSchedule
from recsys_pipe.testing import end_rank


def _sibling(name):
    """The worker module `name` beside this file, loaded by its path (a torchrun script has its
    folder on sys.path, a forked rank does not)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_pp = _sibling("pp_parity_worker")
SPLIT2, SPLIT4, M = _pp.SPLIT2, _pp.SPLIT4, _pp.M
make_opt, make_stages, result, train = _pp.make_opt, _pp.make_stages, _pp.result, _pp.train

WIDTH, SHARD, STEPS, DP = 32, 16, 2, 2


def make_global_data():
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(DP * SHARD, WIDTH, generator=g), torch.randn(DP * SHARD, 1, generator=g)) for _ in range(STEPS)
    ]


def shard(x, y, d):
    return x[d * SHARD : (d + 1) * SHARD], y[d * SHARD : (d + 1) * SHARD]


def runtimes(stages, local, ranks_of_stages, mesh, link):
    n = len(stages)
    return {
        s: StageRuntime(
            stages[s],
            s,
            n,
            prev_rank=mesh.rank_of(ranks_of_stages[s - 1]) if s > 0 else None,
            next_rank=mesh.rank_of(ranks_of_stages[s + 1]) if s < n - 1 else None,
            link=link,
            dp_group=mesh.dp_group,
        )
        for s in local
    }


def data_of(mesh):
    return [shard(x, y, mesh.dp_rank) for x, y in make_global_data()]


def run_plan(schedule, mesh, link):
    stages = make_stages(SPLIT2)
    resolved = resolve_schedule(schedule, 2, M, None)  # a lookahead schedule, compiled to action lists
    runtimes_ = runtimes(stages, [mesh.pp_rank], (0, 1), mesh, link)
    runner = ActionOrderRunner(runtimes_, resolved.actions, mesh.pp_rank, resolved.ranks_of_stages, M, link=link)
    return train(runner, [stages[mesh.pp_rank]], data_of(mesh))


def run_actions(name, mesh, link):
    stages = make_stages(SPLIT4)
    ranks = stage_ranks(2, 2, "v")
    local = [s for s, r in enumerate(ranks) if r == mesh.pp_rank]
    actions = PipelineSchedule.of(get_schedule_ops(name, 2, M, 2))
    runner = ActionOrderRunner(runtimes(stages, local, ranks, mesh, link), actions, mesh.pp_rank, ranks, M, link=link)
    return train(runner, [stages[s] for s in local], data_of(mesh))


def reference():
    stages = make_stages(SPLIT2)
    module = ChainedStages(stages)
    opt = make_opt(module.parameters())
    losses = []
    for step, (x, y) in enumerate(make_global_data()):
        per_replica = []
        step_losses = []
        for d in range(DP):
            opt.zero_grad(set_to_none=True)
            xs, ys = shard(x, y, d)
            replica_losses = []
            for j, (a, b) in enumerate(zip(xs.chunk(M), ys.chunk(M), strict=True)):
                with microbatch_seed(step, d * M + j):
                    loss = module({"x": a, "y": b}, ())
                loss.backward()
                replica_losses.append(loss.item())
            per_replica.append([p.grad.div_(M).clone() for p in module.parameters()])
            step_losses.append(replica_losses)
        for p, g0, g1 in zip(module.parameters(), *per_replica, strict=True):
            p.grad = g0.div(DP) + g1.div(DP)
        opt.step()
        losses.append(step_losses)
    return result(stages, losses)


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    mesh = PipelineMesh.create(2)
    link = PeerLink()
    results = {"coords": (mesh.pp_rank, mesh.dp_rank)}
    for schedule in ("1f1b", "zb_h2"):
        results[f"ours/{schedule}"] = run_plan(schedule, mesh, link)
    results["ours/ZBVZeroBubble"] = run_actions("ZBVZeroBubble", mesh, link)
    if dist.get_rank() == 0:
        results["reference"] = reference()
    end_rank(os.path.join(out_dir, f"rank{dist.get_rank()}.pt"), results)


if __name__ == "__main__":
    main()
