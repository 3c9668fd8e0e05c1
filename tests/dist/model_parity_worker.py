"""Worker for test_model_parity: run under torchrun with 2 ranks (gloo, CPU).

Like train_parity_worker (HSTU on every plan), for the other model paths: torchrec's DLRM and
DLRM_DCN, the plain-torch DLRM (DDP), torchrec's sharding planner, the balanced batch
shuffler, and the next-item retrieval models (SASRec with BCE, HSTU with sampled softmax) on a
generated "user item" file. Each group trains the same batches from the same initial weights
through several plans and records per-step losses, trained sample ids and final parameters; the test compares every
variant of a group bitwise with the group's reference. Writes rank<r>.json into argv[1].
"""

import os
import sys
import time

import torch

from recsys_pipe.data import make_dataloader
from recsys_pipe.runtime import init_distributed
from recsys_pipe.testing import end_rank, load_run, parity_overrides, run_torchrec_pipeline
from recsys_pipe.train import Trainer, build_model, build_parts, local_parameters, training_plan

STEPS = 10
COMMON = parity_overrides(STEPS)
THREADED = ["pipeline.executor=threaded"]
#: group -> (overrides of every variant, {variant: its overrides}); the first variant is the reference
SEQUENCES = "{out}/sequences_rank{rank}.txt"  # one copy per rank: no rank waits for another's file
RETRIEVAL = ["data=sequences", f"data.path={SEQUENCES}", "data.eval_negatives=20"]
GROUPS = {
    "dlrm": (
        ["model=dlrm"],
        {
            "serial": ["pipeline=serial"],
            "sparse_dist": ["pipeline=sparse_dist"],
            "hstu_sparse_dist/threaded": ["pipeline=hstu_sparse_dist", *THREADED],
            "hstu_prefetch/threaded": ["pipeline=hstu_prefetch", *THREADED],
            "hstu_prefetch/per_task": ["pipeline=hstu_prefetch", *THREADED, "thread_map=per_task"],
            # DLRM's samples all cost the same: the balanced plans run and leave every batch in place
            "serial_balanced": ["pipeline=serial_balanced"],
            "hstu_prefetch_balanced/threaded": ["pipeline=hstu_prefetch_balanced"],
        },
    ),
    "dlrm_dcn": (
        ["model=dlrm_dcn"],
        {"serial": ["pipeline=serial"], "hstu_prefetch/threaded": ["pipeline=hstu_prefetch", *THREADED]},
    ),
    "dlrm_planner": (
        ["model=dlrm", "model.sharding=planner", "model.sharding_constraints={cat_0_table:[column_wise]}"],
        {"serial": ["pipeline=serial"], "hstu_prefetch/threaded": ["pipeline=hstu_prefetch", *THREADED]},
    ),
    "hstu_planner": (
        ["model.sharding=planner"],
        {"serial": ["pipeline=serial"], "hstu_prefetch/threaded": ["pipeline=hstu_prefetch", *THREADED]},
    ),
    "dlrm_torch": (
        ["model=dlrm_torch"],
        {
            "serial": ["pipeline=serial"],
            "sparse_dist": ["pipeline=sparse_dist"],
            "hstu_prefetch/threaded": ["pipeline=hstu_prefetch", *THREADED],
        },
    ),
    "balanced": (
        ["data.synthetic.length_distribution=zipf", "data.max_seq_len=32", "data.synthetic.min_seq_len=5"],
        {
            "serial_balanced": ["pipeline=serial_balanced"],
            "hstu_sparse_dist_balanced/threaded": ["pipeline=hstu_sparse_dist_balanced"],
            "hstu_prefetch_balanced/threaded": ["pipeline=hstu_prefetch_balanced"],
            "hstu_prefetch_balanced/per_task": ["pipeline=hstu_prefetch_balanced", "thread_map=per_task"],
        },
    ),
    # the thread maps and the other balanced plans are exercised on DLRM and HSTU above
    "sasrec": (
        [*RETRIEVAL, "model=sasrec"],
        {
            "serial": ["pipeline=serial"],
            "sparse_dist": ["pipeline=sparse_dist"],
            "hstu_prefetch/threaded": ["pipeline=hstu_prefetch", *THREADED],
            "serial_balanced": ["pipeline=serial_balanced"],
        },
    ),
    # the item table on torchrec's dense kernel, updated by Adam with the encoder (SASRec's setup)
    "sasrec_dense": (
        [*RETRIEVAL, "model=sasrec", "model.compute_kernel=dense", "model.sharding=row_wise", "optimizer=adam"],
        {"serial": ["pipeline=serial"], "hstu_prefetch/threaded": ["pipeline=hstu_prefetch", *THREADED]},
    ),
    "hstu_retrieval": (
        [*RETRIEVAL, "model=hstu_retrieval", "model.num_negatives=32", "model.sharding=row_wise"],
        {
            "serial": ["pipeline=serial"],
            "sparse_dist": ["pipeline=sparse_dist"],
            "hstu_prefetch/threaded": ["pipeline=hstu_prefetch", *THREADED],
            "hstu_sparse_dist_balanced/threaded": ["pipeline=hstu_sparse_dist_balanced"],
        },
    ),
    "balanced_vs_loaded": (
        ["data.synthetic.length_distribution=zipf", "data.synthetic.min_seq_len=5"],
        {"serial": ["pipeline=serial"], "serial_balanced": ["pipeline=serial_balanced"]},
    ),
}


def write_sequences(path, users=400, items=120, jump=0.25):
    """A "user item" file: each user walks a chain of items (the next is the last + 3) with random
    starts and lengths, and with probability `jump` a step goes to a random item instead.

    The jumps keep the ranking metrics informative: on a chain without them every held-out item
    follows from the one before, and HSTU (generative-recommenders' maths) learns the rule within
    the test's 10 steps, so its sampled HR@10 reaches 1 and could not tell a ranking bug apart."""
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for u in range(1, users + 1):
            n = int(torch.randint(3, 20, (1,), generator=g))
            item = int(torch.randint(0, items, (1,), generator=g))
            walk = [item]
            for _ in range(n - 1):
                jumps = float(torch.rand((), generator=g)) < jump
                item = int(torch.randint(0, items, (1,), generator=g)) if jumps else (item + 3) % items
                walk.append(item)
            f.writelines(f"{u} {i + 1}\n" for i in walk)


def fingerprint(params):
    return {k: hash(v.numpy().tobytes()) for k, v in params.items()}


def train_variant(info, overrides, batches):
    run = load_run(*COMMON, *overrides)
    trainer = Trainer(build_parts(run, training_plan(run), info))
    try:
        start = time.perf_counter()
        summary = trainer.fit(iter(batches), record_steps=True)
        out = {
            "losses": summary.losses,
            "sample_ids": [ids.tolist() for ids in summary.sample_ids],
            "params": fingerprint(local_parameters(trainer.state.model)),
            "seconds": time.perf_counter() - start,
        }
        plan = getattr(trainer.state.model, "plan", None)
        if plan is not None:
            out["sharding_plan"] = str(plan)
        if trainer.state.balancer is not None:
            out["balance"] = trainer.state.balancer.stats.summary()
        if trainer.retrieval is not None:  # the distributed evaluation of the trained weights
            out["eval"] = trainer.evaluate()
        return out
    finally:
        trainer.close()


def train_torchrec(info, overrides, batches):
    """torchrec's own TrainPipelineSparseDist on the same model and batches."""
    run = load_run(*COMMON, *overrides, "pipeline=serial")
    model, opt = build_model(run, info, run.data.spec())
    losses, ids = run_torchrec_pipeline(model, opt, info.device, batches)
    return {"losses": losses, "sample_ids": ids, "params": fingerprint(local_parameters(model))}


def main():
    torch.set_num_threads(1)
    info = init_distributed("cpu", "gloo")
    sequences = SEQUENCES.format(out=sys.argv[1], rank=info.rank)
    write_sequences(sequences)
    out = {}
    for group, (common, variants) in GROUPS.items():
        common = [o.replace(SEQUENCES, sequences) for o in common]
        reference = next(iter(variants.values()))
        loader = make_dataloader(load_run(*COMMON, *common, *reference).data, info.rank, info.world_size)
        batches = list(loader)
        result = {"loader_ids": [b.sample_ids.tolist() for b in batches], "variants": {}}
        for name, overrides in variants.items():
            result["variants"][name] = train_variant(info, [*common, *overrides], batches)
        if group in ("dlrm", "sasrec_dense"):
            result["variants"]["torchrec_TrainPipelineSparseDist"] = train_torchrec(info, common, batches)
        out[group] = result

    end_rank(os.path.join(sys.argv[1], f"rank{info.rank}.json"), out)


if __name__ == "__main__":
    main()
