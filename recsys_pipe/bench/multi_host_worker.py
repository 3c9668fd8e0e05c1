"""The ranks of the multi-host scenario (`recsys-bench multi_host`, `scripts/multi_host.sh`) and of
its subset in the test suite (tests/integration/test_multi_host.py), on the CPU under gloo. Run as
`python -m recsys_pipe.bench.multi_host_worker <mode> ...` by torchrun (or the suite's
`fork_ranks`); every mode writes JSON (and the batches it trained) into its `<out>` folder.

* `sharded <out> <steps> <case>:<variant>,<variant>... ...` (N ranks, e.g. 2 hosts x 4): for each
  case (`CASES`) and each of its variants (a sharding type forced through `model.sharding` /
  constraints, `VARIANTS`), trains `<steps>` steps of this rank's share of the data from the same
  initial weights; writes `<case>_rank<r>.json` (each variant's per-step loss of the global
  batch, its sharding plan, its seconds) and `<case>_batches_rank<r>.pt`.
* `one_rank <out> <world> <case>...` (1 process): the reference: one rank trains the global
  batches of the `<world>`-rank run (step s = the ranks' step-s batches concatenated in rank
  order); writes `<case>_one_rank.json`.
* `leg <out> <name> <global batch> <until> <sharding> [<previous leg>] [fused|dense]` (N ranks):
  one leg of a run broken across world sizes and sharding types: DLRM on `data=parquet` (files
  under `<out>/data`, written by the first leg: `EPOCH` global batches and half a batch), with
  `data.batch_size = <global batch> / N`, resumed from the previous leg's checkpoint, trained to
  step `<until>` and checkpointed there. `fused`: the tables on the fused kernel with Adagrad (a
  moment per entry); `dense`: on the dense kernel, updated by Adam (two moments) with the rest
  of the model. Writes `<name>_rank<r>.json` (start step, losses, sample ids), its batches, and
  on one rank `<name>_state.pt` (the tables and their optimizer state).
* `unbroken <out> <name> <leg>... [fused|dense]` (1 process): the same run unbroken on one rank
  over the legs' global batches, written like a one-rank leg.
* `rss <out> <steps> <override>...` (N ranks): trains the configured run and writes
  `rss_rank<r>.json`, the rank's peak resident memory (`ru_maxrss`) in bytes.

Why N ranks equal one rank: the models' loss is a mean over a rank's samples (DLRM) or over the
global tokens (HSTU with `model.loss_normalization=global_tokens`), torchrec divides the tables'
gradients by the world size and DDP averages the dense ones, and every layout starts from the same
seeded tables (`recsys_pipe.models.sharding`); the optimizers are elementwise (Adagrad, not
row-wise Adagrad, whose one value per row of each column shard differs from one per row).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from recsys_pipe.data import make_dataloader
from recsys_pipe.runtime import init_distributed
from recsys_pipe.testing import load_run
from recsys_pipe.train import Trainer, build_parts, local_parameters, training_plan

COMMON = [
    "pipeline=serial",
    "trainer.progress_bar=false",
    "trainer.eval_every=0",
    "trainer.tensorboard=false",
    "trainer.device=cpu",
    "trainer.backend=gloo",
    "trainer.max_steps=null",
]
#: case -> (its overrides, per-rank batch size)
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
    # the planner held to one type for one table, its own choice for the others
    "planner/cat_0_table=table_row_wise": [
        "model.sharding=planner",
        "model.sharding_constraints={cat_0_table:[table_row_wise]}",
    ],
    "planner/item_table=column_wise": [
        "model.sharding=planner",
        "model.sharding_constraints={item_table:[column_wise]}",
    ],
}
#: the broken run's epoch: global batches of the Parquet files (and half a batch no epoch trains)
EPOCH = 30
CHAIN = [
    "model=dlrm",
    "data=parquet",
    "data.num_embeddings=64",
    "data.shuffle=true",
    "data.shuffle_window=64",
    "optimizer=adam",
    "trainer.eval_batches=0",  # no held-out batches: every row but the last half batch is in the epoch
    "trainer.checkpoint.interval=1000",  # saved at the end of each leg only
]
#: the tables' kernel and optimizer in a broken run
KERNELS = {"fused": ["optimizer.sparse.name=adagrad"], "dense": ["model.compute_kernel=dense"]}


def mean_over_ranks(losses: list[float]) -> list[float]:
    """Each step's loss averaged over the ranks (`TrainSummary.losses` are this rank's): the
    global batch's loss."""
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def overrides(case: str, batch_size: int, steps: int, *extra: str) -> list[str]:
    common, _ = CASES[case]
    return [*COMMON, *common, f"data.batch_size={batch_size}", f"data.num_batches={steps}", *extra]


def sharded(out: str, steps: str, *cases: str) -> None:
    info = init_distributed("cpu", "gloo")
    for spec in cases:
        case, variants = spec.split(":", 1)
        _train_variants(info, out, case, int(steps), variants.split(","))
    dist.barrier()
    dist.destroy_process_group()


def _train_variants(info: Any, out: str, case: str, steps: int, variants: list[str]) -> None:
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
            seconds = time.perf_counter() - start
            result[variant] = {"losses": mean_over_ranks(summary.losses), "seconds": seconds}
            result[variant]["plan"] = str(trainer.state.model.plan)
        finally:
            trainer.close()
    _write(out, f"{case}_rank{info.rank}.json", result)


def global_batches(out: str, name: str) -> list[Any]:
    """A run's global batches: each step's batches of its ranks, concatenated in rank order."""
    ranks = sum(1 for f in os.listdir(out) if f.startswith(f"{name}_batches_rank"))
    per_rank = [torch.load(os.path.join(out, f"{name}_batches_rank{r}.pt"), weights_only=False) for r in range(ranks)]
    return [type(parts[0]).concat(list(parts)) for parts in zip(*per_rank)]


def one_rank(out: str, world: str, *cases: str) -> None:
    info = init_distributed("cpu", "gloo")
    for case in cases:
        batches = global_batches(out, case)
        run = load_run(*overrides(case, CASES[case][1] * int(world), len(batches)))
        trainer = Trainer(build_parts(run, training_plan(run), info))
        try:
            summary = trainer.fit(iter(batches), record_steps=True)
        finally:
            trainer.close()
        _write(out, f"{case}_one_rank.json", {"losses": summary.losses})
    dist.destroy_process_group()


def write_data(directory: str, global_batch: int) -> None:
    """Criteo-layout Parquet files of `EPOCH` global batches and half a batch more (which no epoch
    trains): two files with row groups of different sizes."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    rows = EPOCH * global_batch + global_batch // 2
    rng = np.random.default_rng(0)
    cols = {"label": pa.array(rng.integers(0, 2, rows).astype(np.int8))}
    cols.update({f"int_{i}": pa.array(rng.integers(0, 50, rows)) for i in range(13)})
    cols.update({f"cat_{i}": pa.array(rng.integers(0, 1000, rows)) for i in range(26)})
    table = pa.table(cols)
    pq.write_table(table.slice(0, rows // 2), os.path.join(directory, "a.parquet"), row_group_size=50)
    pq.write_table(table.slice(rows // 2), os.path.join(directory, "b.parquet"), row_group_size=90)


def chain_run(out: str, global_batch: int, until: int, sharding: str, kernel: str, world: int) -> Any:
    return load_run(
        *COMMON,
        *CHAIN,
        *KERNELS[kernel],
        f"data.path={os.path.join(out, 'data', '*.parquet')}",
        f"data.batch_size={global_batch // world}",
        f"trainer.max_steps={until}",
        f"model.sharding={sharding}",
    )


def table_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's table shards and their optimizer state (a one-rank run: whole tables), by name."""
    state = {k: v for k, v in local_parameters(trainer.state.model).items() if "embedding_bags" in k}
    for key, value in _flat_tensors(trainer.optimizer.state_dict()["optimizer"]).items():
        if "embedding_bags" in key:
            state[f"optim:{key}"] = value
    return state


def _flat_tensors(tree: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict (a ShardedTensor's local shard), by dotted key."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat_tensors(value, f"{path}."))
        elif isinstance(value, ShardedTensor) and value.local_shards():
            out[path] = value.local_shards()[0].tensor.detach().clone()
        elif isinstance(value, torch.Tensor) and not isinstance(value, ShardedTensor) and value.dim() > 0:
            out[path] = value.detach().clone()
    return out


def leg(out: str, name: str, global_batch: str, until: str, sharding: str, *rest: str) -> None:
    previous = next((r for r in rest if r not in KERNELS), None)
    kernel = next((r for r in rest if r in KERNELS), "fused")
    info = init_distributed("cpu", "gloo")
    if info.is_main and not os.path.isdir(os.path.join(out, "data")):
        write_data(os.path.join(out, "data"), int(global_batch))
    run_dir = os.path.join(out, name, "run")
    if info.is_main:
        os.makedirs(run_dir, exist_ok=True)
    dist.barrier()
    run = chain_run(out, int(global_batch), int(until), sharding, kernel, info.world_size)
    trainer = Trainer(build_parts(run, training_plan(run), info, run_dir))
    try:
        if previous is not None:
            trainer.restore(os.path.join(out, previous, "run", "checkpoints", f"step_{_end_step(out, previous)}"))
        start = trainer.step
        loader = trainer.data.train_loader(run.trainer.epochs, trainer.position.batch)
        batches = [b for b, _ in zip(loader, range(int(until) - start))]
        summary = trainer.fit(iter(batches), record_steps=True)
        if info.world_size == 1:
            torch.save(table_state(trainer), os.path.join(out, f"{name}_state.pt"))
    finally:
        trainer.close()
    torch.save(batches, os.path.join(out, f"{name}_batches_rank{info.rank}.pt"))
    record = {
        "start": start,
        "losses": mean_over_ranks(summary.losses),
        "sample_ids": [ids.tolist() for ids in summary.sample_ids],
        "batches_per_epoch": trainer.data.batches_per_epoch,
    }
    _write(out, f"{name}_rank{info.rank}.json", record)
    dist.barrier()
    dist.destroy_process_group()


def _end_step(out: str, name: str) -> int:
    """The step a leg ended at (its checkpoint's)."""
    with open(os.path.join(out, f"{name}_rank0.json")) as f:
        record = json.load(f)
    return record["start"] + len(record["losses"])


def unbroken(out: str, name: str, *legs: str) -> None:
    kernel = legs[-1] if legs and legs[-1] in KERNELS else "fused"
    legs = tuple(leg_name for leg_name in legs if leg_name not in KERNELS)
    info = init_distributed("cpu", "gloo")
    batches = [b for leg_name in legs for b in global_batches(out, leg_name)]
    run = chain_run(out, batches[0].batch_size, len(batches), "table_wise", kernel, 1)
    trainer = Trainer(build_parts(run, training_plan(run), info))
    try:
        summary = trainer.fit(iter(batches), record_steps=True)
        torch.save(table_state(trainer), os.path.join(out, f"{name}_state.pt"))
    finally:
        trainer.close()
    _write(out, f"{name}_rank0.json", {"start": 0, "losses": summary.losses})
    dist.destroy_process_group()


def rss(out: str, steps: str, *extra: str) -> None:
    info = init_distributed("cpu", "gloo")
    run = load_run(*COMMON, f"trainer.max_steps={steps}", *extra)
    trainer = Trainer(build_parts(run, training_plan(run), info))
    try:
        trainer.fit()
    finally:
        trainer.close()
    _write(out, f"rss_rank{info.rank}.json", {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    dist.barrier()
    dist.destroy_process_group()


def _write(out: str, name: str, record: dict[str, Any]) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(record, f)


MODES = {"sharded": sharded, "one_rank": one_rank, "leg": leg, "unbroken": unbroken, "rss": rss}

if __name__ == "__main__":
    torch.set_num_threads(1)
    MODES[sys.argv[1]](*sys.argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort an orderly shutdown (as in recsys_pipe.cli.train.main)
