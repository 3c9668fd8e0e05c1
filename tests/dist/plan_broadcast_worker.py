"""Worker for test_multi_host: 2 ranks (gloo, CPU) whose planners disagree, as torchrec's planner
can between processes (it breaks ties in the order it iterates sets of strings, and Python
randomises string hashing per process): rank 1's planner is made to place every table on rank 1.
`make_sharded_model` must shard by rank 0's plan on both ranks. Writes rank<r>.json: the
placements of the model's plan and of this rank's own planner."""

import json
import os
import sys

import torch
import torch.distributed as dist

import recsys_pipe.models.sharding as sharding
from recsys_pipe.runtime import init_distributed
from recsys_pipe.testing import load_run


def main(out):
    info = init_distributed("cpu", "gloo")
    run = load_run("model=dlrm", "data.num_embeddings=100", "model.sharding=planner")
    planner = sharding.sharding_plan

    def disagreeing(model, cfg, *args, **kwargs):
        plan = planner(model, cfg, *args, **kwargs)
        if info.rank == 1:
            for table in plan.plan["model.sparse_arch.embedding_bag_collection"].values():
                for shard in table.sharding_spec.shards:
                    shard.placement = type(shard.placement)("rank:1/cpu")
                table.ranks = [1]
        return plan

    sharding.sharding_plan = disagreeing
    torch.manual_seed(0)
    module = run.model.build(run.data.spec())
    own = disagreeing(module, run.model, 2, "cpu", 2)
    model = sharding.make_sharded_model(module, run.model, dist.group.WORLD, torch.device("cpu"))

    def placements(plan):
        tables = plan.plan["model.sparse_arch.embedding_bag_collection"]
        return {name: [str(s.placement) for s in t.sharding_spec.shards] for name, t in tables.items()}

    with open(os.path.join(out, f"rank{info.rank}.json"), "w") as f:
        json.dump({"used": placements(model.plan), "own": placements(own)}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
