"""Worker for test_pp_parity: run under torchrun (gloo, CPU), 2 ranks.

A stack of Linear + ReLU + dropout layers with a regression head, split into 2 stages, trains
3 SGD steps of 4 microbatches under every single-stage schedule on our engine (GPipe, 1F1B,
ZB-H1, ZB-H2) and under torch.distributed.pipelining's own classes on the same stages
(ScheduleGPipe, Schedule1F1B, and its runtime playing our ZB-H1 / ZB-H2 CSVs). Rank 0 also
runs the reference in one process: the whole model as one stage (`parallel.pp.size=1`) on the
same engine, and a plain loop (forward, loss.backward per microbatch, grads / m).

Each rank saves `rank<r>.pt`: {variant: {"losses": [per step, per microbatch], "params":
{name: tensor}}} for its stage; rank 0 adds "reference/*" variants holding the whole model.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from recsys_pipe.autosched.pp_actions import to_csv
from recsys_pipe.autosched.pp_schedules import build
from recsys_pipe.pp import (
    ChainedStages,
    PeerLink,
    SeededDropout,
    StageRuntime,
    StageStepRunner,
    microbatch_seed,
    stage_plan,
)

WIDTH, LAYERS, BATCH, M, STEPS, P_DROP, LR = 32, 4, 16, 4, 3, 0.2, 0.05
SPLIT = ((0, 1), (2, 3))  # layers of stage 0 and stage 1


class ToyStage(nn.Module):
    """Layers `layers` of the stack; the last stage adds the head and the loss."""

    def __init__(self, layers, first, last):
        super().__init__()
        self.first, self.last = first, last
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), SeededDropout(P_DROP, layer=i)) for i in layers]
        )
        self.head = nn.Linear(WIDTH, 1) if last else None

    def body(self, x):
        h = self.layers(x)
        return self.head(h) if self.last else h

    def forward(self, batch, inputs):
        out = self.body(batch["x"] if self.first else inputs[0])
        return F.mse_loss(out, batch["y"]) if self.last else out


def make_stages():
    torch.manual_seed(0)
    return [ToyStage(layers, s == 0, s == len(SPLIT) - 1) for s, layers in enumerate(SPLIT)]


def make_data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 1, generator=g)) for _ in range(STEPS)]


def microbatches(x, y):
    return [{"x": a, "y": b} for a, b in zip(x.chunk(M), y.chunk(M), strict=True)]


def result(module, losses):
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in module.named_parameters()}}


def run_ours(schedule, module, stage, p, link, rank):
    prev = rank - 1 if stage > 0 else None
    nxt = rank + 1 if stage < p - 1 else None
    runtime = StageRuntime(module, stage, p, prev_rank=prev, next_rank=nxt, link=link)
    runner = StageStepRunner(runtime, stage_plan(schedule, p, stage, M))
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    losses = []
    for step, (x, y) in enumerate(make_data()):
        opt.zero_grad(set_to_none=True)
        out = runner.run_step(step, microbatches(x, y))
        losses.append([None if v is None else v.item() for v in out])
        opt.step()
    runner.shutdown()
    return result(module, losses)


class TorchAdapter(nn.Module):
    """A stage as torch's PipelineStage calls it, `forward(x)`; the loss goes to loss_fn.
    Forwards of a stage run in microbatch order, so a counter gives the dropout key."""

    def __init__(self, stage):
        super().__init__()
        self.stage, self.step, self.count = stage, 0, 0

    def forward(self, x):
        with microbatch_seed(self.step, self.count):
            self.count += 1
            return self.stage.body(x)


def run_torch(kind, module, rank, out_dir):
    adapter = TorchAdapter(module)
    mb_in = torch.zeros(BATCH // M, WIDTH, requires_grad=not module.first)  # received: needs a gradient
    mb_out = torch.zeros(BATCH // M, 1 if module.last else WIDTH, requires_grad=True)
    stage = PipelineStage(adapter, rank, 2, torch.device("cpu"), input_args=(mb_in,), output_args=(mb_out,))
    if kind == "ScheduleGPipe":
        schedule = ScheduleGPipe(stage, M, loss_fn=F.mse_loss)
    elif kind == "Schedule1F1B":
        schedule = Schedule1F1B(stage, M, loss_fn=F.mse_loss)
    else:  # our generator's CSV on torch's runtime
        path = os.path.join(out_dir, f"{kind}.csv")
        if rank == 0:
            to_csv(build(kind, 2, M), path)
        dist.barrier()
        schedule = _PipelineScheduleRuntime([stage], M, loss_fn=F.mse_loss)
        schedule._load_csv(path)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    losses = []
    for step, (x, y) in enumerate(make_data()):
        adapter.step, adapter.count = step, 0
        opt.zero_grad(set_to_none=True)
        mb_losses = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=mb_losses)
        losses.append([v.item() for v in mb_losses] if mb_losses else [None] * M)
        opt.step()
    return result(module, losses)


def reference_engine():
    module = ChainedStages(make_stages())
    return run_ours("1f1b", module, 0, 1, None, 0)


def reference_loop(shift=0):
    """A plain loop; `shift` moves every microbatch's dropout key (a control: masks matter)."""
    module = ChainedStages(make_stages())
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    losses = []
    for step, (x, y) in enumerate(make_data()):
        opt.zero_grad(set_to_none=True)
        step_losses = []
        for j, mb in enumerate(microbatches(x, y)):
            with microbatch_seed(step, j + shift):
                loss = module(mb)
            loss.backward()
            step_losses.append(loss.item())
        for p in module.parameters():
            p.grad.div_(M)
        losses.append(step_losses)
        opt.step()
    return result(module, losses)


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    link = PeerLink()
    results = {}
    for schedule in ("gpipe", "1f1b", "zb_h1", "zb_h2"):
        results[f"ours/{schedule}"] = run_ours(schedule, make_stages()[rank], rank, 2, link, rank)
    for kind in ("ScheduleGPipe", "Schedule1F1B", "zb_h1", "zb_h2"):
        results[f"torch/{kind}"] = run_torch(kind, make_stages()[rank], rank, out_dir)
    if rank == 0:
        results["reference/engine"] = reference_engine()
        results["reference/loop"] = reference_loop()
        results["control/shifted_masks"] = reference_loop(shift=1)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.2)


if __name__ == "__main__":
    main()
