"""Worker for test_train_parity: run under torchrun with 2 ranks (gloo, CPU).

Trains the same batches from the same initial weights through every shipped plan (sequential
and threaded executors) and through torchrec's own TrainPipelineSparseDist, and records
per-step losses, trained sample ids and final parameters (dense and every local embedding
shard). Also runs the train/eval interleaving and learning-signal checks. Writes
rank<r>.json into the directory given as argv[1]; the test asserts on it.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from recsys_pipe.data import make_dataloader
from recsys_pipe.runtime import init_distributed
from recsys_pipe.testing import load_run, run_torchrec_pipeline
from recsys_pipe.train import Trainer, build_model, local_parameters, training_plan

STEPS = 24
VARIANTS = {
    "serial": ["pipeline=serial"],
    "sparse_dist": ["pipeline=sparse_dist"],
    "hstu_sparse_dist/sequential": ["pipeline=hstu_sparse_dist", "pipeline.executor=sequential"],
    "hstu_sparse_dist/threaded": ["pipeline=hstu_sparse_dist", "pipeline.executor=threaded"],
    "hstu_prefetch/sequential": ["pipeline=hstu_prefetch", "pipeline.executor=sequential"],
    "hstu_prefetch/threaded": ["pipeline=hstu_prefetch", "pipeline.executor=threaded"],
    "hstu_prefetch/per_task": ["pipeline=hstu_prefetch", "pipeline.executor=threaded", "thread_map=per_task"],
    # global-token loss normalisation: the derived all-reduce task, serial and pipelined
    "global/serial": ["pipeline=serial", "model.loss_normalization=global_tokens"],
    "global/hstu_prefetch/threaded": ["pipeline=hstu_prefetch", "model.loss_normalization=global_tokens"],
}
COMMON = [
    "optimizer=sgd",
    "trainer.progress_bar=false",
    "trainer.eval_every=0",
    "trainer.device=cpu",
    "trainer.backend=gloo",
    "data.batch_size=16",
    f"data.num_batches={STEPS}",
    "trainer.max_steps=null",
]


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
    result = tune(plan.schedule, costs, dict(plan.thread_of), max_evaluations=300, seed=0)
    assert result.changes and any(c.changed for c in result.changes), "the tuner changed nothing"
    plan_yaml(
        result.schedule,
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
    return Trainer(run, training_plan(run), info)


def train_variant(info, overrides, batches):
    trainer = make_trainer(overrides, info)
    try:
        summary = trainer.fit(iter(batches), record_steps=True)
        return summary, local_parameters(trainer.state.model)
    finally:
        trainer.close()


def train_torchrec(info, batches):
    run = run_config(["pipeline=serial"])
    spec = make_dataloader(run.data, info.rank, info.world_size).dataset.spec
    model, opt = build_model(run, info, spec)
    losses, ids = run_torchrec_pipeline(model, opt, info.device, batches)
    return losses, ids, local_parameters(model)


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

    losses, ids, params = train_torchrec(info, batches)
    out["variants"]["torchrec_TrainPipelineSparseDist"] = {
        "losses": losses,
        "sample_ids": ids,
        "params": {k: hash(v.numpy().tobytes()) for k, v in params.items()},
    }

    # train -> eval -> train in one session: evaluation between steps must not change training
    interleaved = make_trainer(["pipeline=hstu_prefetch", "trainer.eval_every=5", "trainer.eval_batches=2"], info)
    try:
        summary = interleaved.fit(iter(batches), record_steps=True)
        out["interleaved"] = {
            "losses": summary.losses,
            "sample_ids": [s.tolist() for s in summary.sample_ids],
            "evals": summary.evals,
        }
        eval_ids = [b.sample_ids.tolist() for b in interleaved.eval_loader]
        out["eval_ids"] = eval_ids
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

    with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
