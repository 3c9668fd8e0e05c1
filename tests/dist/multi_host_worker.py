"""Worker of the multi-host checks (tests/integration/test_multi_host.py, scripts/multi_host.sh):
sharded tables on several ranks against one rank over the same global batches (gloo, CPU).

`sharded <out> <case> <steps> <variant>...` (N ranks, e.g. 2 hosts x 2 or x 4): for each variant
of the case (a sharding type, `VARIANTS`), trains `<steps>` steps of this rank's share of the
data from the same initial weights and writes `<out>/<case>_rank<r>.json` with each variant's
per-step losses (averaged over the ranks: the loss of the global batch), its sharding plan and seconds; rank r's batches go to
`<out>/<case>_batches_rank<r>.pt`.

`leg <out> <name> <global batch> <until> <sharding> [<checkpoint>] [dense]` (N ranks): one leg of a
run broken across world sizes and sharding types: DLRM with `data=parquet` (the files under
`<out>/data`, written by the first leg), `data.batch_size = <global batch> / N`, resumed from
`<checkpoint>` if given, trained to step `<until>` and checkpointed there (`<out>/<name>/run`);
`dense`: the tables on torchrec's dense kernel, updated by Adam with the rest of the model, else
on the fused kernel with Adagrad. Writes `<out>/<name>_rank<r>.json` (start step, per-step mean
losses, sample ids) and its batches; the last leg (1 rank) also `<out>/<name>_state.pt`, its
tables and their optimizer state.

`unbroken <out> <name> <leg>...` (1 process): the same run unbroken on one rank over the legs'
global batches, written like a 1-rank leg (`<name>_rank0.json`, `<name>_state.pt`).

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


CHAIN = [
    "model=dlrm",
    "data=parquet",
    "data.num_embeddings=64",
    "data.shuffle=true",
    "data.shuffle_window=64",
    "optimizer=adam",
    "trainer.eval_batches=0",  # no held-out tail: the epoch is every row but the last 16
    "trainer.checkpoint.interval=1000",  # saved at the end of each leg only
]
#: the tables on the fused kernel (Adagrad: a moment per table entry) or the dense one (Adam's two)
KERNELS = {"fused": ["optimizer.sparse.name=adagrad"], "dense": ["model.compute_kernel=dense"]}
#: rows of the Parquet files: 30 global batches of 32 and a tail no epoch trains
ROWS = 30 * 32 + 16


def write_data(directory):
    """Criteo-layout Parquet files: two files with row groups of different sizes."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    cols = {"label": pa.array(rng.integers(0, 2, ROWS).astype(np.int8))}
    cols.update({f"int_{i}": pa.array(rng.integers(0, 50, ROWS)) for i in range(13)})
    cols.update({f"cat_{i}": pa.array(rng.integers(0, 1000, ROWS)) for i in range(26)})
    table = pa.table(cols)
    pq.write_table(table.slice(0, 400), os.path.join(directory, "a.parquet"), row_group_size=50)
    pq.write_table(table.slice(400), os.path.join(directory, "b.parquet"), row_group_size=90)


def chain_run(out, name, global_batch, until, sharding, kernel, world):
    return load_run(
        *COMMON,
        *CHAIN,
        *KERNELS[kernel],
        f"data.path={os.path.join(out, 'data', '*.parquet')}",
        f"data.batch_size={int(global_batch) // world}",
        f"trainer.max_steps={until}",
        f"model.sharding={sharding}",
    )


def table_state(trainer):
    """This (single) rank's tables and their optimizer state, by name."""
    from recsys_pipe.train import local_parameters

    state = {k: v for k, v in local_parameters(trainer.state.model).items() if "embedding_bags" in k}
    for key, value in flat_tensors(trainer.optimizer.state_dict()["optimizer"]).items():
        if "embedding_bags" in key:
            state[f"optim:{key}"] = value
    return state


def flat_tensors(tree, prefix=""):
    """Every tensor of a nested state dict (a ShardedTensor's one local shard), by dotted key."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_tensors(value, f"{path}."))
        elif isinstance(value, ShardedTensor):
            out[path] = value.local_shards()[0].tensor.detach().clone()
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            out[path] = value.detach().clone()
    return out


def leg(out, name, global_batch, until, sharding, checkpoint=None, kernel="fused"):
    info = init_distributed("cpu", "gloo")
    if checkpoint in KERNELS:
        checkpoint, kernel = None, checkpoint
    if info.is_main and not os.path.isdir(os.path.join(out, "data")):
        write_data(os.path.join(out, "data"))
    run_dir = os.path.join(out, name, "run")
    if info.is_main:
        os.makedirs(run_dir, exist_ok=True)
    dist.barrier()
    run = chain_run(out, name, global_batch, until, sharding, kernel, info.world_size)
    trainer = Trainer(build_parts(run, training_plan(run), info, run_dir))
    try:
        if checkpoint is not None:
            trainer.restore(os.path.join(out, checkpoint, "run", "checkpoints", f"step_{trainer_step(out, checkpoint)}"))
        start = trainer.step
        loader = trainer.data.train_loader(run.trainer.epochs, trainer.position.batch)
        batches = [b for b, _ in zip(loader, range(int(until) - start))]
        summary = trainer.fit(iter(batches), record_steps=True)
        if info.world_size == 1:
            torch.save(table_state(trainer), os.path.join(out, f"{name}_state.pt"))
    finally:
        trainer.close()
    record = {
        "start": start,
        "losses": mean_over_ranks(summary.losses),
        "sample_ids": [ids.tolist() for ids in summary.sample_ids],
        "batches_per_epoch": trainer.data.batches_per_epoch,
    }
    torch.save(batches, os.path.join(out, f"{name}_batches_rank{info.rank}.pt"))
    with open(os.path.join(out, f"{name}_rank{info.rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


def trainer_step(out, name):
    """The step a leg ended at (its checkpoint's)."""
    record = json.load(open(os.path.join(out, f"{name}_rank0.json")))
    return record["start"] + len(record["losses"])


def global_batches(out, name):
    """A leg's global batches: each step's batches of its ranks, concatenated in rank order."""
    ranks = sorted(f for f in os.listdir(out) if f.startswith(f"{name}_batches_rank"))
    per_rank = [torch.load(os.path.join(out, f"{name}_batches_rank{r}.pt"), weights_only=False) for r in range(len(ranks))]
    return [type(parts[0]).concat(list(parts)) for parts in zip(*per_rank)]


def unbroken(out, name, *legs, kernel="fused"):
    if legs and legs[-1] in KERNELS:
        legs, kernel = legs[:-1], legs[-1]
    info = init_distributed("cpu", "gloo")
    batches = [b for leg_name in legs for b in global_batches(out, leg_name)]
    run = chain_run(out, name, batches[0].batch_size, len(batches), "table_wise", kernel, 1)
    trainer = Trainer(build_parts(run, training_plan(run), info))
    try:
        summary = trainer.fit(iter(batches), record_steps=True)
        torch.save(table_state(trainer), os.path.join(out, f"{name}_state.pt"))
    finally:
        trainer.close()
    with open(os.path.join(out, f"{name}_rank0.json"), "w") as f:
        json.dump({"start": 0, "losses": summary.losses}, f)
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
    {"sharded": sharded, "one_rank": one_rank, "leg": leg, "unbroken": unbroken}[sys.argv[1]](*sys.argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
