"""Worker for test_engine_distributed: run under torchrun with 2 ranks (gloo).

Each rank drives the same task graph of collective-issuing tasks with a *different* thread map
and random delays, so without the ordered lock the ranks would issue all_reduces in different
orders (tensor sizes differ per task, so a mismatch fails loudly instead of mixing numbers).
Results are compared with a sequential run of the same task graph on the same rank.

Then shortcut replay across ranks: the same threaded runs with two collective tasks skipped
(both ranks enable the same shortcuts) must keep every other collective matched, and a DDP
model whose output goes through a skipped task must still see every parameter reached in
backward (zero gradients, no unused-parameter error), where a plain detached replay makes DDP
fail.
"""

import os
import random
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from recsys_pipe.engine import PlanRunner, Task, TaskFailedError, TaskGraph, ThreadedExecutor
from recsys_pipe.testing import end_rank

SIZES = {"shuffle": 3, "start_dist": 5, "wait_dist": 7, "tokens": 1, "backward": 11, "finalize": 13}


def build(results, rng):
    def collective(ctx):
        time.sleep(rng.random() * 0.004)
        name = ctx.task.name
        x = torch.full((SIZES[name],), float(ctx.batch_index + 1 + dist.get_rank() * 10))
        dist.all_reduce(x)
        results[(name, ctx.batch_index)] = x.tolist()

    def compute(ctx):
        time.sleep(rng.random() * 0.004)

    def t(name, **kw):
        return Task.from_fn(name, collective, nccl=True, **kw)

    return TaskGraph.single_group(
        [
            t("shuffle", stream="memcpy", lookahead=2),
            t("start_dist", stream="data_dist", lookahead=1, depends_on=["shuffle"]),
            t("wait_dist", stream="data_dist", lookahead=1, depends_on=["start_dist"]),
            t("tokens", lookahead=0),
            Task.from_fn("forward", compute, lookahead=0),
            t("backward", lookahead=0, depends_on=["forward"]),
            t("finalize", lookahead=0, depends_on=["backward"]),
        ]
    )


def drive(executor, seed, shortcuts=()):
    results = {}
    with PlanRunner(build(results, random.Random(seed)), executor=executor) as runner:
        if shortcuts:
            runner.enable_shortcut(shortcuts)
        for _ in runner.iterate(range(10)):
            pass
    return {f"{k[0]}:{k[1]}": v for k, v in sorted(results.items())}


SKIPPED = ("start_dist", "tokens")


class TwoHeads(torch.nn.Module):
    """One output goes straight to the loss, the other through the skipped task."""

    def __init__(self):
        super().__init__()
        self.direct = torch.nn.Linear(3, 4)
        self.through_mid = torch.nn.Linear(3, 4)

    def forward(self, x):
        return self.direct(x), self.through_mid(x)


def ddp_through_skipped_task(detached):
    """Loss computed from a DDP model's output through `mid`, which is shortcut; returns each
    step's gradients (None where a parameter got none). `detached`: mid cuts the graph instead
    (what a replay without grafting would do)."""
    torch.manual_seed(0)
    model = DistributedDataParallel(TwoHeads())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def zero_grad(ctx):
        opt.zero_grad()

    def embed(ctx):
        direct, through_mid = model(ctx.slots["batch_cpu"])
        ctx.slots.set("direct", direct)
        ctx.slots.set("h", through_mid)

    def mid(ctx):
        h = ctx.slots["h"]
        ctx.slots.set("z", torch.tanh(h.detach() if detached else h) * 2 + 1)

    def head(ctx):
        ctx.slots.set("loss", ctx.slots["direct"].mean() + ctx.slots["z"].mean())

    def backward(ctx):
        ctx.slots["loss"].backward()
        grads = [None if p.grad is None else p.grad.abs().sum().item() for p in model.parameters()]
        opt.step()
        ctx.slots.set("step_result", grads)

    task_graph = TaskGraph.single_group(
        [
            Task.from_fn("zero_grad", zero_grad),
            Task.from_fn("embed", embed, reads=["batch_cpu"], writes=["direct", "h"], depends_on=["zero_grad"]),
            Task.from_fn("mid", mid, reads=["h"], writes=["z"]),
            Task.from_fn("head", head, reads=["direct", "z"], writes=["loss"]),
            Task.from_fn("backward", backward, reads=["loss"], writes=["step_result"]),
        ]
    )
    data = [torch.randn(5, 3, generator=torch.Generator().manual_seed(b)) for b in range(5)]
    with PlanRunner(task_graph, executor=ThreadedExecutor("per_task")) as runner:
        if not detached:
            runner.enable_shortcut("mid")
        try:
            return {"grads": list(runner.iterate(data))}
        except TaskFailedError as exc:
            return {"error": f"{exc} <- {exc.__cause__}"}


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    thread_map = ["per_task", {"shuffle": "io", "default": "compute"}][rank]
    threaded = drive(ThreadedExecutor(thread_map), seed=rank)
    sequential = drive("sequential", seed=rank)
    ok = threaded == sequential
    shortcut = drive(ThreadedExecutor(thread_map), seed=rank, shortcuts=SKIPPED)
    kept = {k: v for k, v in sequential.items() if k.split(":")[0] not in SKIPPED}
    shortcut_ok = {k: v for k, v in shortcut.items() if k.split(":")[0] not in SKIPPED} == kept
    out = {
        "ok": ok,
        "results": threaded,
        "shortcut_ok": shortcut_ok,
        "skipped_runs": sorted(k for k in shortcut if k.split(":")[0] in SKIPPED),
        "ddp_grafted": ddp_through_skipped_task(detached=False),
        "ddp_detached": ddp_through_skipped_task(detached=True),
    }
    end_rank(os.path.join(sys.argv[1], f"rank{rank}.json"), out)


if __name__ == "__main__":
    main()
