"""Worker for test_engine_distributed: run under torchrun with 2 ranks (gloo).

Each rank drives the same schedule of collective-issuing tasks with a *different* thread map
and random delays, so without the ordered lock the ranks would issue all_reduces in different
orders (tensor sizes differ per task, so a mismatch fails loudly instead of mixing numbers).
Results are compared with a sequential run of the same schedule on the same rank.
"""

import json
import os
import random
import sys
import time

import torch
import torch.distributed as dist

from recsys_pipe.engine import SchedulablePipeline, Schedule, Task, ThreadedExecutor

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

    return Schedule.single_stage(
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


def drive(executor, seed):
    results = {}
    with SchedulablePipeline(build(results, random.Random(seed)), executor=executor) as pipe:
        for _ in pipe.iterate(range(10)):
            pass
    return {f"{k[0]}:{k[1]}": v for k, v in sorted(results.items())}


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    thread_map = ["per_task", {"shuffle": "io", "default": "compute"}][rank]
    threaded = drive(ThreadedExecutor(thread_map), seed=rank)
    sequential = drive("sequential", seed=rank)
    ok = threaded == sequential
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"ok": ok, "results": threaded}, f)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.2)  # let gloo's threads wind down before interpreter teardown


if __name__ == "__main__":
    main()
