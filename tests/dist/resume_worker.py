"""Worker for test_resume: run under torchrun with 2 ranks (gloo, CPU), or alone for `reshard`.

`main <out>` (2 ranks): for each plan, trains 15 steps with checkpoints, then a fresh trainer
resumes from that run directory and trains to step 30; compares per-step losses and final
parameters (dense tensors and every local embedding shard) with one uninterrupted 30-step run of
the serial plan; the same for the tables on the dense kernel and for `model.table_init=per_shard`
(against its own uninterrupted run). The configuration exercises everything a checkpoint must restore: Adam moments,
rowwise-Adagrad table state, a cosine LR schedule with warmup, gradient clipping, dropout (RNG),
two shuffled epochs (the resume lands mid-epoch 1 and crosses into epoch 2) and evaluations.
Writes rank<r>.json (and the step-15 parameters as rank<r>_step15.pt for `reshard`).

`reshard <checkpoint> <out> [dense]` (1 process): loads a 2-rank checkpoint through DCP's
resharding (`dense`: of the dense-kernel run, with the tables' Adam moments), writes the loaded
parameters, then trains 5 more steps.

`accumulation <out> <plan>...` (1 or 2 ranks): gradient accumulation over 4 micro-steps, for each
plan: an uninterrupted 24-step run (checkpoints at 8, 16, 24), a run resumed from its step-8
checkpoint, and a run that gets SIGTERM inside a window (the last rank, at step 13) and its
resume; writes accumulation_rank<r>.json.

`semi_sync <out> <plan>...` (2 ranks): semi-synchronous plans (SEMI_SYNC_PLANS: semi_sync,
semi_sync_stash, semi_sync/threaded) with a warm-up of 3 batches (start_batch=2), for each: an
uninterrupted 10-step run (checkpoints every 2 steps), runs resumed from its steps 2 and 4, and
a control resume from step 4 without the saved lookups (semi_sync) or kept gradients
(semi_sync_stash); writes semi_sync_rank<r>.json.
"""

import os
import shutil
import sys

import torch
import torch.distributed as dist

from recsys_pipe.runtime import init_distributed
from recsys_pipe.testing import FAULT_ENV, FAULT_OVERRIDE, built_trainer, end_rank
from recsys_pipe.train import local_parameters, resolve_resume

CONFIG = [
    "trainer=smoke",
    "optimizer=adam",
    "optimizer.schedule=cosine",
    "optimizer.warmup_steps=5",
    "optimizer.decay_steps=30",  # the first part stops at step 15: the LR schedule must not follow it
    "optimizer.clip_grad_norm=0.5",
    "model.dropout=0.1",
    "data.batch_size=16",
    "data.num_batches=20",
    "data.shuffle=true",
    "trainer.epochs=2",
    "trainer.eval_every=10",
    "trainer.eval_batches=2",
    "trainer.log_every=5",
    "trainer.tensorboard=false",
]
PLANS = {
    "serial": ["pipeline=serial"],
    "hstu_sparse_dist": ["pipeline=hstu_sparse_dist"],
    "hstu_prefetch": ["pipeline=hstu_prefetch"],
    "hstu_prefetch/async": ["pipeline=hstu_prefetch", "trainer.checkpoint.async=true"],
}
#: the tables on torchrec's dense kernel, split by rows: Adam (the dense optimizer) updates them,
#: and its moments for the tables are sharded state that every rank must save and get back
DENSE_KERNEL = ["pipeline=hstu_prefetch", "model.compute_kernel=dense", "model.sharding=row_wise"]
#: the tables built on the meta device, each rank drawing only its own row shards
PER_SHARD = ["pipeline=hstu_prefetch", "model.table_init=per_shard", "model.sharding=row_wise"]


def fit(info, run_dir, *overrides, restore=None):
    """A run of CONFIG and `overrides` trained to its end (`built_trainer`; checkpoints into
    `run_dir` if given), after restoring the checkpoint `restore` if given: its summary and this
    rank's final parameters."""
    with built_trainer(info, [*CONFIG, *overrides], run_dir) as t:
        if restore is not None:
            t.restore(restore)
        return t.fit(record_steps=True), local_parameters(t.state.model)


def digest(params):
    return {k: hash(v.numpy().tobytes()) for k, v in params.items()}


def main(out):
    info = init_distributed("cpu", "gloo")
    result = {"plans": {}}
    with built_trainer(info, [*CONFIG, "pipeline=serial", "trainer.max_steps=30"]) as t:
        loader_ids = [b.sample_ids.tolist() for b in t.data.train_loader(epochs=2)]  # both epochs, in order
        ref, ref_params = t.fit(record_steps=True), local_parameters(t.state.model)
    result["reference"] = {
        "losses": ref.losses,
        "params": digest(ref_params),
        "evals": [e["step"] for e in ref.evals],
        "sample_ids": [ids.tolist() for ids in ref.sample_ids],
        "loader_ids": loader_ids[:30],
        "epoch_sizes": [len({i for b in loader_ids[e * 20 : (e + 1) * 20] for i in b}) for e in range(2)],
    }
    for name, overrides in PLANS.items():
        run_dir = os.path.join(out, name.replace("/", "_"))
        first, params15 = fit(info, run_dir, *overrides, "trainer.max_steps=15", "trainer.checkpoint.interval=15")
        if name == "serial":
            torch.save(params15, os.path.join(out, f"rank{info.rank}_step15.pt"))
        dist.barrier()
        path = str(resolve_resume(run_dir, "unused"))  # a run directory: its newest checkpoint
        second, params = fit(info, None, *overrides, "trainer.max_steps=30", restore=path)
        result["plans"][name] = {
            "checkpoint": os.path.relpath(path, out),
            "first_losses": first.losses,
            "first_stop": first.stop_reason,
            "resumed_at": second.start_step,
            "losses": second.losses,
            "params": digest(params),
            "num_params": len(params),
            "stop": second.stop_reason,
        }
    result["dense_kernel"] = dense_kernel(info, out)
    result["per_shard"] = per_shard(info, out)
    # negative control: the same checkpoint without its RNG states must not resume bitwise
    # (dropout draws from them), or the comparison above would not show they are restored
    no_rng = os.path.join(out, "no_rng")
    if info.is_main:
        shutil.copytree(os.path.join(out, "serial", "checkpoints", "step_15"), no_rng)
        shutil.rmtree(os.path.join(no_rng, "rng"))
    dist.barrier()
    control, _ = fit(info, None, "pipeline=serial", "trainer.max_steps=30", restore=no_rng)
    result["no_rng_losses"] = control.losses
    end_rank(os.path.join(out, f"rank{info.rank}.json"), result)


def dense_kernel(info, out):
    """Uninterrupted 30 steps vs 15 + resume + 15 with the tables on the dense kernel; also the
    global shapes under which the checkpoint holds the tables' Adam moments."""
    from recsys_pipe.train.checkpoint import read_metadata

    ref, ref_params = fit(info, None, *DENSE_KERNEL, "trainer.max_steps=30")
    run_dir = os.path.join(out, "dense_kernel")
    first, _ = fit(info, run_dir, *DENSE_KERNEL, "trainer.max_steps=15", "trainer.checkpoint.interval=15")
    dist.barrier()
    path = resolve_resume(run_dir, "unused")
    second, params = fit(info, None, *DENSE_KERNEL, "trainer.max_steps=30", restore=str(path))
    saved = read_metadata(path).state_dict_metadata
    moments = {key: list(meta.size) for key, meta in saved.items() if key.endswith("exp_avg") and "embeddings" in key}
    tables = {
        key: list(meta.size) for key, meta in saved.items() if key.startswith("train.model.") and "embeddings" in key
    }
    return {
        "ref_losses": ref.losses,
        "ref_params": digest(ref_params),
        "losses": first.losses + second.losses,
        "params": digest(params),
        "moments": moments,
        "tables": tables,
    }


def per_shard(info, out):
    """Uninterrupted 30 steps vs 15 + resume + 15 with `model.table_init=per_shard`; this rank's
    initial parameters (its row shards and the dense part) go to rank<r>_per_shard.pt."""
    with built_trainer(info, [*CONFIG, *PER_SHARD, "trainer.max_steps=30"]) as t:
        torch.save(local_parameters(t.state.model), os.path.join(out, f"rank{info.rank}_per_shard.pt"))
        ref, ref_params = t.fit(record_steps=True), local_parameters(t.state.model)
    run_dir = os.path.join(out, "per_shard")
    first, _ = fit(info, run_dir, *PER_SHARD, "trainer.max_steps=15", "trainer.checkpoint.interval=15")
    dist.barrier()
    path = str(resolve_resume(run_dir, "unused"))
    second, params = fit(info, None, *PER_SHARD, "trainer.max_steps=30", restore=path)
    return {
        "ref_losses": ref.losses,
        "ref_params": digest(ref_params),
        "losses": first.losses + second.losses,
        "resumed_at": second.start_step,
        "params": digest(params),
    }


def reshard(checkpoint, out, kernel="fused"):
    info = init_distributed("cpu", "gloo")
    overrides = DENSE_KERNEL if kernel == "dense" else ["pipeline=hstu_prefetch"]
    with built_trainer(info, [*CONFIG, *overrides, "trainer.max_steps=20"]) as t:
        t.restore(checkpoint)
        loaded = local_parameters(t.state.model)
        start = t.step, t.position.batch
        moments = {  # dense kernel: the tables' Adam moments, loaded whole onto this one rank
            name: [list(p.shape), float(t.optimizer.dense.state[p]["exp_avg"].abs().sum())]
            for name, p in t.state.model.named_parameters()
            if "embeddings" in name and p in t.optimizer.dense.state
        }
        summary = t.fit(record_steps=True)
    torch.save(loaded, os.path.join(out, "resharded.pt"))
    end_rank(
        os.path.join(out, "reshard.json"),
        {"start": start, "losses": summary.losses, "end_step": summary.end_step, "moments": moments},
    )


#: 4 micro-steps per optimizer step (2 warm-up micro-steps), checkpoints at window ends
ACCUMULATION = [
    "trainer.grad_accumulation.steps=4",
    "trainer.grad_accumulation.warmup_steps=2",
    "trainer.max_steps=24",
    "trainer.checkpoint.interval=8",
    "trainer.preemption_check_s=0",  # agree on a stop every step: the stop step is known exactly
]


def accumulation(out, plans):
    info = init_distributed("cpu", "gloo")
    result = {}
    for plan in plans:
        overrides = [*ACCUMULATION, f"pipeline={plan}"]
        ref_dir = os.path.join(out, plan, "reference")
        ref, ref_params = fit(info, ref_dir, *overrides)
        dist.barrier()
        resumed, params = fit(info, None, *overrides, restore=os.path.join(ref_dir, "checkpoints", "step_8"))
        stop_dir = os.path.join(out, plan, "sigterm")
        os.environ[FAULT_ENV] = f"sigterm:{info.world_size - 1}:13"
        try:
            stopped, _ = fit(info, stop_dir, *overrides, FAULT_OVERRIDE)
        finally:
            del os.environ[FAULT_ENV]
        dist.barrier()
        after, after_params = fit(info, None, *overrides, restore=str(resolve_resume(stop_dir, "unused")))
        result[plan] = {
            "ref_losses": ref.losses,
            "ref_params": digest(ref_params),
            "resumed_at": resumed.start_step,
            "resumed_losses": resumed.losses,
            "resumed_params": digest(params),
            "stopped": [stopped.stop_reason, stopped.end_step, os.path.basename(stopped.checkpoint or "")],
            "stopped_losses": stopped.losses,
            "after_at": after.start_step,
            "after_losses": after.losses,
            "after_params": digest(after_params),
        }
    end_rank(os.path.join(out, f"accumulation_rank{info.rank}.json"), result)


#: semi-synchronous plans with a synchronous warm-up of batches 0..2 (start_batch=2), checkpoints every 2 steps
SEMI_SYNC = [
    "pipeline.tasks.start_embedding_lookup.options.start_batch=2",
    "trainer.max_steps=10",
    "trainer.checkpoint.interval=2",
    "trainer.checkpoint.keep_latest=0",
]
#: the resumes: step 2 (inside the warm-up, the resumed run crosses into the semi-synchronous
#: steps) and step 4 (after it: warming up again would train steps 4..6 on fresh embeddings)
SEMI_SYNC_RESUMES = (2, 4)
SEMI_SYNC_PLANS = {
    "semi_sync": ["pipeline=semi_sync"],
    "semi_sync_stash": ["pipeline=semi_sync_stash"],
    "semi_sync/threaded": ["pipeline=semi_sync", "pipeline.executor=threaded", "thread_map=per_task"],
}
#: what the control resume's checkpoint loses of what was in flight, per plan
SEMI_SYNC_CONTROL = {"semi_sync": "lookups", "semi_sync_stash": "grad_stash"}


def semi_sync(out, plans):
    """For each plan (a key of SEMI_SYNC_PLANS): an uninterrupted 10-step run, its resumes from
    SEMI_SYNC_RESUMES, and for the plans of SEMI_SYNC_CONTROL a control resume from step 4 whose
    rank files lost part of what was in flight."""
    info = init_distributed("cpu", "gloo")
    result = {}
    for plan in plans:
        overrides = [*SEMI_SYNC, *SEMI_SYNC_PLANS[plan]]
        ref_dir = os.path.join(out, plan.replace("/", "_"))
        ref, ref_params = fit(info, ref_dir, *overrides)
        dist.barrier()
        checkpoints = os.path.join(ref_dir, "checkpoints")
        got = {"ref_losses": ref.losses, "ref_params": digest(ref_params), "resumes": {}, "in_flight": {}}
        for step in SEMI_SYNC_RESUMES:
            path = os.path.join(checkpoints, f"step_{step}")
            resumed, params = fit(info, None, *overrides, restore=path)
            own = torch.load(os.path.join(path, "rng", f"rank{info.rank}.pt"), weights_only=True)["in_flight"]
            got["in_flight"][step] = {
                "lookup_steps": sorted(own.get("lookups", {})),
                "stashed": len(own.get("grad_stash", {})),
            }
            got["resumes"][step] = {"at": resumed.start_step, "losses": resumed.losses, "params": digest(params)}
        result[plan] = got
        if plan not in SEMI_SYNC_CONTROL:
            continue
        control = os.path.join(out, f"{plan}_control")
        if info.is_main:  # the step-4 checkpoint without part of what was in flight
            shutil.copytree(os.path.join(checkpoints, "step_4"), control)
            for rank_file in os.scandir(os.path.join(control, "rng")):
                state = torch.load(rank_file.path, weights_only=True)
                del state["in_flight"][SEMI_SYNC_CONTROL[plan]]
                torch.save(state, rank_file.path)
        dist.barrier()
        lost, _ = fit(info, None, *overrides, restore=control)
        got["control_losses"] = lost.losses
    end_rank(os.path.join(out, f"semi_sync_rank{info.rank}.json"), result)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "reshard":
        reshard(*sys.argv[2:])
    elif sys.argv[1] == "accumulation":
        accumulation(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "semi_sync":
        semi_sync(sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv[2])
