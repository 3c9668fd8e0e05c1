"""Worker for test_train_parity: run under torchrun with 2 ranks (gloo, CPU).

Trains the same batches from the same initial weights through every shipped plan (sequential
and threaded executors) and through torchrec's own classes (TrainPipelineSparseDist, with and
without enqueue_batch_after_forward, TrainPipelineBase, TrainPipelineSparseDistLite), and records
per-step losses, trained sample ids and final parameters (dense and every local embedding
shard). Also runs the train/eval interleaving and learning-signal checks. Writes
rank<r>.json (and the accumulation check's tables as rank<r>_accumulate_<name>.pt) into the
directory given as argv[1]; the test asserts on them.
"""

import os
import sys
import time

import torch

from recsys_pipe.data import make_dataloader
from recsys_pipe.runtime import init_distributed
from recsys_pipe.testing import (
    end_rank,
    load_run,
    parity_overrides,
    run_stale_embedding_reference,
    run_torchrec_pipeline,
)
from recsys_pipe.train import Trainer, build_model, build_parts, local_parameters, training_plan

STEPS = 24
GA4 = ["trainer.grad_accumulation.steps=4", "trainer.grad_accumulation.warmup_steps=2"]
START_BATCH = 5
WARM = f"pipeline.tasks.start_embedding_lookup.options.start_batch={START_BATCH}"
INPLACE = "pipeline.tasks.h2d.options.inplace_copy=true"
VARIANTS = {
    "serial": ["pipeline=serial"],
    "sparse_dist": ["pipeline=sparse_dist"],
    "base": ["pipeline=base"],
    "sparse_dist_lite": ["pipeline=sparse_dist_lite"],
    "sparse_dist_enqueue_after_forward": ["pipeline=sparse_dist_enqueue_after_forward"],
    "prefetch": ["pipeline=prefetch"],
    "fused_sparse_dist": ["pipeline=fused_sparse_dist"],
    # embeddings one step stale: compared with run_stale_embedding_reference, not with serial
    "stale/semi_sync": ["pipeline=semi_sync"],
    "stale/semi_sync/threaded": ["pipeline=semi_sync", "pipeline.executor=threaded", "thread_map=per_task"],
    "stash/semi_sync_stash": ["pipeline=semi_sync_stash"],
    # synchronous warm-up (torchrec's start_batch): batches 0..5 fresh, then one step stale
    "warm/semi_sync": ["pipeline=semi_sync", WARM],
    "warm/semi_sync/threaded": ["pipeline=semi_sync", WARM, "pipeline.executor=threaded", "thread_map=per_task"],
    "warmstash/semi_sync_stash": ["pipeline=semi_sync_stash", WARM],
    # gradient accumulation on the stale plan: against torchrec's wrapper around the stale loop
    "ga4stale/semi_sync": ["pipeline=semi_sync", *GA4],
    "ga4stale/semi_sync/threaded": ["pipeline=semi_sync", *GA4, "pipeline.executor=threaded"],
    # in-place batch copy (torchrec's enable_inplace_copy_batch)
    "inplace/sparse_dist": ["pipeline=sparse_dist", INPLACE],
    "inplace/hstu_prefetch/threaded": ["pipeline=hstu_prefetch", INPLACE],
    "hstu_sparse_dist/sequential": ["pipeline=hstu_sparse_dist", "pipeline.executor=sequential"],
    "hstu_sparse_dist/threaded": ["pipeline=hstu_sparse_dist", "pipeline.executor=threaded"],
    "hstu_prefetch/sequential": ["pipeline=hstu_prefetch", "pipeline.executor=sequential"],
    "hstu_prefetch/threaded": ["pipeline=hstu_prefetch", "pipeline.executor=threaded"],
    "hstu_prefetch/per_task": ["pipeline=hstu_prefetch", "pipeline.executor=threaded", "thread_map=per_task"],
    # gradient accumulation (torchrec's semantics): 4 micro-steps, 2 warmup, on several plans
    "ga4/serial": ["pipeline=serial", *GA4],
    "ga4/sparse_dist": ["pipeline=sparse_dist", *GA4],
    "ga4/hstu_prefetch/threaded": ["pipeline=hstu_prefetch", *GA4],
    # 5 micro-steps: 24 batches end inside a window (torchrec's flush of the last 4)
    "ga5/sparse_dist": ["pipeline=sparse_dist", "trainer.grad_accumulation.steps=5"],
    # global-token loss normalisation: the derived all-reduce task, serial and pipelined
    "global/serial": ["pipeline=serial", "model.loss_normalization=global_tokens"],
    "global/hstu_prefetch/threaded": ["pipeline=hstu_prefetch", "model.loss_normalization=global_tokens"],
}
COMMON = parity_overrides(STEPS)


# Hand-written CPU costs (seconds) for which the tuner changes threads and lookaheads.
TUNE_COSTS = {
    "h2d": 0.002,
    "start_input_dist": 0.001,
    "wait_input_dist": 0.002,
    "zero_grad": 0.0002,
    "forward": 0.004,
    "backward": 0.006,
    "finalize_model_grads": 0.0001,
    "optimizer_step": 0.001,
}


def tuned_plan_overrides(directory):
    """Tune hstu_sparse_dist with TUNE_COSTS (deterministic budget), write it as a plan file,
    return the overrides that load it: a tuned plan must train exactly like the serial plan."""
    from recsys_pipe.autosched import CostModel, TaskCost, plan_yaml, tune

    plan = training_plan(run_config(["pipeline=hstu_sparse_dist"]))
    costs = CostModel({name: TaskCost(cpu) for name, cpu in TUNE_COSTS.items()})
    result = tune(plan.task_graph, costs, dict(plan.thread_of), max_evaluations=300, seed=0)
    assert result.changes and any(c.changed for c in result.changes), "the tuner changed nothing"
    plan_yaml(
        result.task_graph,
        plan.fn_paths(),
        thread_map=result.thread_map,
        name="tuned",
        path=os.path.join(directory, "pipeline", "tuned.yaml"),
    )
    return ["pipeline=tuned", "thread_map=plan", f"hydra.searchpath=[file://{directory}]"]


def run_config(overrides):
    return load_run(*COMMON, *overrides)


def make_trainer(overrides, info):
    run = run_config(overrides)
    return Trainer(build_parts(run, training_plan(run), info))


def train_variant(info, overrides, batches):
    trainer = make_trainer(overrides, info)
    try:
        summary = trainer.fit(iter(batches), record_steps=True)
        return summary, local_parameters(trainer.state.model)
    finally:
        trainer.close()


#: torchrec's own classes the plans are compared with: name -> (class, constructor options,
#: GradientAccumulationWrapper (steps, warmup_steps) or None)
TORCHREC_PIPELINES = {
    "torchrec_TrainPipelineSparseDist": ("TrainPipelineSparseDist", {}, None),
    "torchrec_TrainPipelineBase": ("TrainPipelineBase", {}, None),
    "torchrec_TrainPipelineSparseDistLite": ("TrainPipelineSparseDistLite", {}, None),
    "torchrec_TrainPipelineSparseDist/enqueue_batch_after_forward": (
        "TrainPipelineSparseDist",
        {"enqueue_batch_after_forward": True},
        None,
    ),
    "torchrec_TrainPipelineSparseDist/enable_inplace_copy_batch": (
        "TrainPipelineSparseDist",
        {"enable_inplace_copy_batch": True},
        None,
    ),
    "ga4/torchrec_GradientAccumulationWrapper(TrainPipelineSparseDist)": ("TrainPipelineSparseDist", {}, (4, 2)),
    "ga5/torchrec_GradientAccumulationWrapper(TrainPipelineSparseDist)": ("TrainPipelineSparseDist", {}, (5, 1)),
}


def train_torchrec(info, batches, pipeline="TrainPipelineSparseDist", options=None, grad_accumulation=None):
    run = run_config(["pipeline=serial"])
    spec = make_dataloader(run.data, info.rank, info.world_size).dataset.spec
    model, opt = build_model(run, info, spec)
    losses, ids = run_torchrec_pipeline(
        model, opt, info.device, batches, pipeline, grad_accumulation=grad_accumulation, **(options or {})
    )
    return losses, ids, local_parameters(model)


def accumulate_vs_large_batch(info, k=4):
    """Plain torch tables (every parameter dense, none updated in backward): 4 accumulated
    micro-batches with scale_loss=true against the serial plan on their concatenation. The
    maths is the same (mean of 4 micro-batch means = the large batch's mean); the sums round
    differently, so the test compares within float tolerance."""
    overrides = ["model=dlrm_torch", "pipeline=serial"]
    run = run_config(overrides)
    micro = list(make_dataloader(run.data, info.rank, info.world_size))
    large = [type(micro[0]).concat(micro[i : i + k]) for i in range(0, len(micro), k)]
    results = {}
    for name, batches, extra in [
        ("large", large, []),
        ("accumulated", micro, [f"trainer.grad_accumulation.steps={k}", "trainer.grad_accumulation.scale_loss=true"]),
        ("summed", micro, [f"trainer.grad_accumulation.steps={k}"]),
    ]:
        summary, params = train_variant(info, [*overrides, *extra], batches)
        # the tables as tensors, not JSON lists (about 10 MB of text per model, slow to write and compare)
        path = os.path.join(sys.argv[1], f"rank{info.rank}_accumulate_{name}.pt")
        torch.save({n: p.detach().flatten().clone() for n, p in params.items()}, path)
        results[name] = {"losses": summary.losses, "params": os.path.basename(path)}
    results["k"] = k
    return results


def main():
    torch.set_num_threads(1)
    info = init_distributed("cpu", "gloo")
    out = {"variants": {}}
    base = run_config(["pipeline=serial"])
    loader = make_dataloader(base.data, info.rank, info.world_size)
    batches = list(loader)
    out["loader_ids"] = [b.sample_ids.tolist() for b in batches]

    variants = dict(VARIANTS)
    variants["tuned"] = tuned_plan_overrides(os.path.join(sys.argv[1], f"tuned_rank{info.rank}"))
    for name, overrides in variants.items():
        start = time.perf_counter()
        summary, params = train_variant(info, overrides, batches)
        out["variants"][name] = {
            "losses": summary.losses,
            "sample_ids": [ids.tolist() for ids in summary.sample_ids],
            "params": {k: hash(v.numpy().tobytes()) for k, v in params.items()},
            "seconds": time.perf_counter() - start,
        }
        if name == "serial":
            initial_trainer = make_trainer(overrides, info)
            initial = local_parameters(initial_trainer.state.model)
            initial_trainer.close()
            out["unchanged_by_training"] = [k for k, v in params.items() if torch.equal(v, initial[k])]
            out["num_params"] = len(params)

    # torchrec's TrainPipelineSemiSync cannot run on the CPU (tests/cuda/test_cuda_family.py runs
    # it): the semi_sync plan is compared with a plain loop of the same staleness
    references = {
        "stale/reference": {},
        "stash/reference": {"stash_gradients": True},
        "warm/reference": {"start_batch": START_BATCH},
        "warmstash/reference": {"stash_gradients": True, "start_batch": START_BATCH},
        "ga4stale/reference": {"grad_accumulation": (4, 2)},  # wrapped in torchrec's wrapper
    }
    for name, options in references.items():
        model, opt = build_model(base, info, loader.dataset.spec)
        losses, ids = run_stale_embedding_reference(model, opt, batches, **options)
        out["variants"][name] = {
            "losses": losses,
            "sample_ids": ids,
            "params": {k: hash(v.numpy().tobytes()) for k, v in local_parameters(model).items()},
        }

    for name, (cls, options, grad_accumulation) in TORCHREC_PIPELINES.items():
        losses, ids, params = train_torchrec(info, batches, cls, options, grad_accumulation)
        out["variants"][name] = {
            "losses": losses,
            "sample_ids": ids,
            "params": {k: hash(v.numpy().tobytes()) for k, v in params.items()},
        }

    out["accumulate_vs_large_batch"] = accumulate_vs_large_batch(info)

    # train -> eval -> train in one session, every 5 steps, 3 held-out batches: evaluation between
    # steps must not change training, and every evaluated output must belong to its batch. The
    # serial plan is the reference of the pipelined ones (hstu_prefetch: 3 batches in flight,
    # threaded; semi_sync: 4 in flight, its own training numbers).
    out["interleaved"] = {}
    for plan in ("serial", "hstu_prefetch", "semi_sync"):
        interleaved = make_trainer([f"pipeline={plan}", "trainer.eval_every=5", "trainer.eval_batches=3"], info)
        try:
            summary = interleaved.fit(iter(batches), record_steps=True)
            out["interleaved"][plan] = {
                "losses": summary.losses,
                "sample_ids": [s.tolist() for s in summary.sample_ids],
                "evals": summary.evals,
            }
            out["eval_ids"] = [b.sample_ids.tolist() for b in interleaved.evaluator.loader]
        finally:
            interleaved.close()

    # learning signal: AUC on held-out data after training vs before the first step
    learn = make_trainer(
        [
            "pipeline=hstu_prefetch",
            "data.num_batches=80",
            "data.batch_size=32",
            "optimizer=adam",
            "trainer.eval_every=80",
            "trainer.eval_batches=4",
        ],
        info,
    )
    try:
        summary = learn.fit(record_steps=True)
        out["learning"] = {
            "evals": summary.evals,
            "first_loss": summary.losses[0],
            "last_losses": summary.losses[-10:],
            "first_losses": summary.losses[:10],
        }
    finally:
        learn.close()

    end_rank(os.path.join(sys.argv[1], f"rank{info.rank}.json"), out)


if __name__ == "__main__":
    main()
