"""Worker of the multi-host checks (tests/integration/test_multi_host.py, scripts/multi_host.sh):
sharded tables on several ranks against one rank over the same global batches (gloo, CPU).

`sharded <out> <case> <steps> <variant>...` (N ranks, e.g. 2 hosts x 2 or x 4): for each variant
of the case (a sharding type, `VARIANTS`), trains `<steps>` steps of this rank's share of the
data from the same initial weights and writes `<out>/<case>_rank<r>.json` with each variant's
per-step losses (averaged over the ranks: the loss of the global batch), its sharding plan and seconds; rank r's batches go to
`<out>/<case>_batches_rank<r>.pt`.

`one_rank <out> <case> <world>` (1 process): the reference: one rank trains the global batches
of the `<world>`-rank run (step s = the ranks' step-s batches concatenated in rank order) and
writes `<out>/<case>_one_rank.json` with its per-step losses.

The model's loss is a mean over a rank's samples (DLRM) or over the global tokens (HSTU with
`model.loss_normalization=global_tokens`); torchrec divides the tables' gradients by the world
size and DDP averages the dense ones, so N ranks compute what one rank computes on the
concatenated batch, up to the order of float sums.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from recsys_pipe.data import make_dataloader
from recsys_pipe.runtime import init_distributed
from recsys_pipe.testing import load_run
from recsys_pipe.train import Trainer, build_parts, training_plan

COMMON = [
    "pipeline=serial",
    "trainer.progress_bar=false",
    "trainer.eval_every=0",
    "trainer.tensorboard=false",
    "trainer.device=cpu",
    "trainer.backend=gloo",
    "trainer.max_steps=null",
]
#: case -> (overrides, per-rank batch size)
CASES = {
    "dlrm": (["model=dlrm", "data.num_embeddings=1000", "optimizer=adam", "optimizer.sparse.name=adagrad"], 8),
    "hstu": (
        [
            "model=hstu_small",
            "model.loss_normalization=global_tokens",
            "optimizer=adam",
            "optimizer.sparse.name=adagrad",
        ],
        4,
    ),
}
#: variant -> the overrides that force it
VARIANTS = {
    "table_wise": ["model.sharding=table_wise"],
    "row_wise": ["model.sharding=row_wise"],
    "column_wise": ["model.sharding=column_wise"],
    "table_column_wise": ["model.sharding=table_column_wise"],
    "table_row_wise": ["model.sharding=table_row_wise"],
    "planner": ["model.sharding=planner"],
    # the planner held to one type for a table (the rest its own choice)
    "planner/cat_0_table=table_row_wise": [
        "model.sharding=planner",
        "model.sharding_constraints={cat_0_table:[table_row_wise]}",
    ],
    "planner/item_table=column_wise": [
        "model.sharding=planner",
        "model.sharding_constraints={item_table:[column_wise]}",
    ],
}


def mean_over_ranks(losses):
    """Each step's loss averaged over the ranks (`TrainSummary.losses` are this rank's)."""
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def overrides(case, batch_size, steps, *extra):
    common, _ = CASES[case]
    return [*COMMON, *common, f"data.batch_size={batch_size}", f"data.num_batches={steps}", *extra]


def sharded(out, case, steps, *variants):
    steps = int(steps)
    info = init_distributed("cpu", "gloo")
    batch = CASES[case][1]
    data = load_run(*overrides(case, batch, steps)).data
    batches = list(make_dataloader(data, info.rank, info.world_size))[:steps]
    torch.save(batches, os.path.join(out, f"{case}_batches_rank{info.rank}.pt"))
    result = {}
    for variant in variants:
        run = load_run(*overrides(case, batch, steps, *VARIANTS[variant]))
        trainer = Trainer(build_parts(run, training_plan(run), info))
        try:
            start = time.perf_counter()
            summary = trainer.fit(iter(batches), record_steps=True)
            result[variant] = {
                "losses": mean_over_ranks(summary.losses),
                "seconds": time.perf_counter() - start,
                "plan": str(trainer.state.model.plan),
            }
        finally:
            trainer.close()
    with open(os.path.join(out, f"{case}_rank{info.rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def one_rank(out, case, world):
    info = init_distributed("cpu", "gloo")
    per_rank = [
        torch.load(os.path.join(out, f"{case}_batches_rank{r}.pt"), weights_only=False) for r in range(int(world))
    ]
    batches = [type(parts[0]).concat(list(parts)) for parts in zip(*per_rank)]
    run = load_run(*overrides(case, CASES[case][1] * int(world), len(batches)))
    trainer = Trainer(build_parts(run, training_plan(run), info))
    try:
        summary = trainer.fit(iter(batches), record_steps=True)
    finally:
        trainer.close()
    with open(os.path.join(out, f"{case}_one_rank.json"), "w") as f:
        json.dump({"losses": summary.losses}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"sharded": sharded, "one_rank": one_rank}[sys.argv[1]](*sys.argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
