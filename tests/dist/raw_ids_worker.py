"""Worker for test_raw_ids: managed-collision tables (`ids: managed`) trained by every shipped plan,
resumed, and evaluated; run as 1 or 2 forked ranks (gloo, CPU). Writes rank<r>.json into argv[1].

Every variant trains the same batches from the same initial weights; each records its per-step
losses, trained sample ids and a digest of every local tensor (dense weights, each table shard and
each managed table's remapping: raw ids, rows, counts/ages). The tables are smaller than the ids
they see, so ids are evicted while the plans train (`evicted_rows` counts the re-initialised rows).

* DLRM, managed bag tables (`data=criteo_synthetic data.ids=managed`, LFU): every plan against
  `serial`.
* HSTU, managed item and user tables (`data=synthetic data.ids=managed`, LRU): the HSTU plans and
  the balanced ones against theirs, semi_sync's two executors against each other; and, with tables
  that admit every id (no row a batch used is evicted), the semi-synchronous plans against the
  stale-embedding reference loop.
* HSTU on Parquet windows of raw 64-bit ids (`data=parquet_sequences data.ids=managed`,
  distance-LFU; `recsys_pipe.testing.raw_id_windows`): HSTU plans against serial.
* SASRec on "user item" lines and HSTU retrieval (per-position sampled negatives) on sequence
  Parquet, raw 64-bit item ids (`recsys_pipe.testing.raw_id_sequences`): the plans against
  serial (a balanced one against serial_balanced); the sampled negatives, candidates and
  catalogue share the managed item table but are not counted (`counted_unseen`: ids counted for
  eviction that no batch had as an input or a target).
* resume: per plan, a run with checkpoints every 4 steps, resumed from step 4 (the middle of an
  eviction interval of 3), against the unbroken run (steps 5 and 6); and a control resume that drops the ids
  counted since the last eviction, which must differ.
* evaluation: `Trainer.evaluate` looks ids up without counting or evicting (the remapping and
  every table unchanged).
"""

import os
import sys
import tempfile

import torch

from recsys_pipe.data import make_dataloader
from recsys_pipe.runtime import init_distributed
from recsys_pipe.testing import (
    built_trainer,
    end_rank,
    load_run,
    parity_overrides,
    raw_id_sequences,
    raw_id_windows,
    run_stale_embedding_reference,
)
from recsys_pipe.train import build_model, local_parameters

STEPS = 6
DLRM = [
    "model=dlrm",
    "data=criteo_synthetic",
    "data.ids=managed",
    "data.num_embeddings=24",
    "data.synthetic.num_samples=4000",
    "data.managed.eviction_interval=2",
    "model.sharding=row_wise",
]
HSTU = [
    "model=hstu_small",
    "data=synthetic",
    "data.ids=managed",
    "data.managed.eviction_policy=lru",
    "data.managed.eviction_interval=2",
    "data.use_user_feature=true",
    "data.synthetic.num_items=40",
    "data.synthetic.num_users=30",
    "model.sharding=row_wise",
]
EVICTING = ["data.item_rows=16", "data.user_rows=12"]
#: every id finds a free row: re-initialised rows are never rows the previous batch updated
ADMITTING = ["data.item_rows=96", "data.user_rows=96"]
THREADED = ["pipeline.executor=threaded", "thread_map=per_task"]

#: name -> (overrides, the variant it must equal)
PLANS = {
    "dlrm/serial": ([*DLRM, "pipeline=serial"], None),
    **{
        f"dlrm/{plan}": ([*DLRM, f"pipeline={plan}"], "dlrm/serial")
        for plan in (
            "base",
            "sparse_dist",
            "sparse_dist_lite",
            "sparse_dist_enqueue_after_forward",
            "prefetch",
            "fused_sparse_dist",
            "dlrm_prefetch",
            "hstu_prefetch",
            "hstu_sparse_dist",
        )
    },
    "dlrm/hstu_prefetch/per_task": ([*DLRM, "pipeline=hstu_prefetch", *THREADED], "dlrm/serial"),
    "hstu/serial": ([*HSTU, *EVICTING, "pipeline=serial"], None),
    "hstu/hstu_prefetch": ([*HSTU, *EVICTING, "pipeline=hstu_prefetch"], "hstu/serial"),
    "hstu/hstu_sparse_dist": ([*HSTU, *EVICTING, "pipeline=hstu_sparse_dist"], "hstu/serial"),
    "hstu/serial_balanced": ([*HSTU, *EVICTING, "pipeline=serial_balanced"], None),
    "hstu/hstu_prefetch_balanced": ([*HSTU, *EVICTING, "pipeline=hstu_prefetch_balanced"], "hstu/serial_balanced"),
    "hstu/hstu_sparse_dist_balanced": (
        [*HSTU, *EVICTING, "pipeline=hstu_sparse_dist_balanced"],
        "hstu/serial_balanced",
    ),
    "hstu/semi_sync": ([*HSTU, *EVICTING, "pipeline=semi_sync"], None),
    "hstu/semi_sync/per_task": ([*HSTU, *EVICTING, "pipeline=semi_sync", *THREADED], "hstu/semi_sync"),
}
#: semi-synchronous plans against the stale-embedding loop: name -> (overrides, reference options)
STALE = {
    "stale/semi_sync": ([*HSTU, *ADMITTING, "pipeline=semi_sync"], {}),
    "stale/semi_sync_stash": ([*HSTU, *ADMITTING, "pipeline=semi_sync_stash"], {"stash_gradients": True}),
}
#: resumed plans: name -> overrides (an eviction every 3 steps, checkpoints every 4)
RESUME = {
    "dlrm/serial": [*DLRM, "pipeline=serial"],
    "dlrm/sparse_dist": [*DLRM, "pipeline=sparse_dist"],
    "dlrm/hstu_prefetch": [*DLRM, "pipeline=hstu_prefetch"],
    "hstu/semi_sync": [*HSTU, *EVICTING, "pipeline=semi_sync"],
}
INTERVAL = ["data.managed.eviction_interval=3", "trainer.checkpoint.interval=4"]


def parquet_variants(out, rank):
    """HSTU on Parquet windows of raw ids (each rank writes the same file): plans and a resume."""
    hstu = [
        *raw_id_windows(os.path.join(out, f"windows{rank}.parquet")),
        "data.managed.eviction_policy=distance_lfu",
        "data.managed.eviction_interval=2",
    ]
    PLANS["hstu_parquet/serial"] = ([*hstu, "pipeline=serial"], None)
    for plan in ("hstu_prefetch", "hstu_sparse_dist"):
        PLANS[f"hstu_parquet/{plan}"] = ([*hstu, f"pipeline={plan}"], "hstu_parquet/serial")
    RESUME["hstu_parquet/hstu_sparse_dist"] = [*hstu, "pipeline=hstu_sparse_dist"]
    evicting = ["data.managed.eviction_interval=2"]
    sasrec = ["model=sasrec", *raw_id_sequences(os.path.join(out, f"users{rank}.txt")), *evicting]
    hstu_retrieval = ["model=hstu_retrieval", "model.num_negatives=16", *evicting]
    hstu_retrieval += raw_id_sequences(os.path.join(out, f"users{rank}.parquet"))
    for name, overrides in (("sasrec", sasrec), ("hstu_retrieval", hstu_retrieval)):
        PLANS[f"{name}/serial"] = ([*overrides, "pipeline=serial"], None)
        for plan in ("sparse_dist", "hstu_prefetch"):
            PLANS[f"{name}/{plan}"] = ([*overrides, f"pipeline={plan}"], f"{name}/serial")
        RESUME[f"{name}/hstu_prefetch"] = [*overrides, "pipeline=hstu_prefetch"]
        RETRIEVAL[name] = overrides
    # rebatched: the per-position negatives' distinct raw ids, made again after the split
    PLANS["hstu_retrieval/serial_balanced"] = ([*hstu_retrieval, "pipeline=serial_balanced"], None)
    PLANS["hstu_retrieval/hstu_sparse_dist_balanced"] = (
        [*hstu_retrieval, "pipeline=hstu_sparse_dist_balanced"],
        "hstu_retrieval/serial_balanced",
    )


#: retrieval on raw ids: name -> overrides
RETRIEVAL = {}


class EvictionCounter:
    """Counts the rows the sharded managed tables re-initialise (their `_evict`)."""

    def __init__(self) -> None:
        from recsys_pipe.models import sharders

        self.rows = 0
        original = sharders._CpuEviction._evict

        def counted(module, evictions):
            self.rows += sum(int(r.numel()) for r in evictions.values() if r is not None)
            return original(module, evictions)

        sharders._CpuEviction._evict = counted


def digest(params):
    return {k: hash(v.numpy().tobytes()) for k, v in params.items()}


def record(summary, model):
    return {
        "losses": [float(x) for x in summary.losses],
        "sample_ids": [ids.tolist() for ids in summary.sample_ids],
        "params": digest(local_parameters(model)),
    }


def train(info, overrides, run_dir=None, restore=None, keep_history=True):
    with built_trainer(info, [*parity_overrides(STEPS), *overrides], run_dir) as trainer:
        if restore is not None:
            trainer.restore(restore)
            if not keep_history:  # the control: the ids counted since the last eviction are lost
                from recsys_pipe.models.managed import managed_rows

                for _, rows in managed_rows(trainer.state.model):
                    rows.load_history_state({"current_iter": -1, "last_eviction_iter": -1, "buffer_size": -1})
        return record(trainer.fit(record_steps=True), trainer.state.model)


def plans(info, counter):
    out = {}
    for name, (overrides, reference) in PLANS.items():
        before = counter.rows
        out[name] = train(info, overrides)
        out[name].update(evicted_rows=counter.rows - before, reference=reference)
    for name, overrides in RETRIEVAL.items():
        out[f"{name}/serial"]["counted_unseen"] = counted_unseen(info, [*overrides, "pipeline=serial"])
    for name, (overrides, options) in STALE.items():
        out[name] = train(info, overrides)
        out[name]["reference"] = f"{name}/reference"
        run = load_run(*parity_overrides(STEPS), *overrides)
        loader = make_dataloader(run.data, info.rank, info.world_size)
        model, optimizer = build_model(run, info, loader.dataset.spec)
        losses, ids = run_stale_embedding_reference(model, optimizer, list(loader), **options)
        out[f"{name}/reference"] = {"losses": losses, "sample_ids": ids, "params": digest(local_parameters(model))}
    return out


def counted_unseen(info, overrides):
    """What the managed item table counted since its last eviction (at step 4 of 6, an interval
    of 4): the ids no batch of steps 5-6 (any rank's) had as an input or a target, and how many
    of those steps' negatives were neither (so that the check is not vacuous)."""
    from recsys_pipe.data.batch import INPUT_KEY, NEG_KEY, POS_KEY
    from recsys_pipe.train.managed import history_state

    overrides = [*parity_overrides(STEPS), *overrides, "data.managed.eviction_interval=4"]
    with built_trainer(info, overrides) as trainer:
        trainer.fit()
        counted = {i for state in history_state(trainer.state.model).values() for i in state["ids"].tolist()}
    run = load_run(*overrides)
    seen, negatives = set(), set()
    for step, batch in enumerate(make_dataloader(run.data, info.rank, info.world_size)):
        if step >= 4:
            kjt = batch.sparse_features
            seen |= set(kjt[INPUT_KEY].values().tolist()) | set(kjt[POS_KEY].values().tolist())
            negatives |= set(kjt[NEG_KEY].values().tolist())
    everyone = [None] * info.world_size
    torch.distributed.all_gather_object(everyone, (seen, negatives))
    seen = set().union(*(s for s, _ in everyone))
    negatives = set().union(*(n for _, n in everyone))
    return {"unseen": len(counted - seen), "counted": len(counted), "negatives_only": len(negatives - seen)}


def resume(info, scratch):
    out = {}
    for name, overrides in RESUME.items():
        run_dir = os.path.join(scratch, name.replace("/", "_"))
        unbroken = train(info, [*overrides, *INTERVAL], run_dir)
        step4 = os.path.join(run_dir, "checkpoints", "step_4")
        resumed = train(info, [*overrides, *INTERVAL], restore=step4)
        control = train(info, [*overrides, *INTERVAL], restore=step4, keep_history=False)
        out[name] = {"unbroken": unbroken, "resumed": resumed, "control": control}
    return out


def evaluation(info):
    overrides = [*parity_overrides(STEPS), *DLRM, "trainer.eval_batches=2"]
    with built_trainer(info, overrides) as trainer:
        trainer.fit()
        before = local_parameters(trainer.state.model)
        trainer.evaluate()
        after = local_parameters(trainer.state.model)
    return {"changed": sorted(k for k in before if not torch.equal(before[k], after[k])), "tensors": len(before)}


def layout(info):
    """This rank's shard of one managed table: the slice of the raw id space its ids lie in."""
    from recsys_pipe.models.managed import managed_rows

    with built_trainer(info, [*parity_overrides(STEPS), *DLRM]) as trainer:
        trainer.fit()
        rows = dict(managed_rows(trainer.state.model))
        name = sorted(rows)[0]
        ids = rows[name]._mch_sorted_raw_ids
        held = ids[ids < torch.iinfo(torch.int64).max]
        block = -(-rows[name]._input_hash_size // info.world_size)
        return {"ids": held.tolist(), "block": block, "offset": rows[name]._output_global_offset}


def main(out, parts):
    info = init_distributed("cpu", "gloo")
    counter = EvictionCounter()
    parquet_variants(out, info.rank)
    result = {"world_size": info.world_size}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = [scratch]
        torch.distributed.broadcast_object_list(scratch)  # one directory for every rank's checkpoints
        if "plans" in parts:
            result["plans"] = plans(info, counter)
        if "resume" in parts:
            result["resume"] = resume(info, scratch[0])
        if "eval" in parts:
            result["evaluation"] = evaluation(info)
            result["layout"] = layout(info)
        torch.distributed.barrier()
    end_rank(os.path.join(out, f"rank{info.rank}.json"), result)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
