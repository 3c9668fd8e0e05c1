"""Worker for tests/cuda/test_cuda_family.py: run under torchrun on CUDA (NCCL, one rank per GPU).

Trains the same batches from the same initial weights through the semi_sync (also with a
synchronous warm-up and with stashed gradients) and fused_sparse_dist plans and through
torchrec's own TrainPipelineSemiSync (start_batch 0 and 5, stash_gradients false and true) and
TrainPipelineFusedSparseDist, which cannot run on the CPU, plus the CPU reference loop of
semi_sync (run_stale_embedding_reference); and sparse_dist with h2d's in-place copy against
TrainPipelineSparseDist(enable_inplace_copy_batch=True), where the copy really runs on a side
stream. Writes rank<r>.json (per-step losses, trained sample ids, a hash of every final local
parameter) into argv[1].
"""

import os
import sys

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

STEPS = 16
COMMON = parity_overrides(STEPS, "cuda", "nccl")
WARM = "pipeline.tasks.start_embedding_lookup.options.start_batch=5"
PLANS = {
    "serial": ["pipeline=serial"],
    "semi_sync": ["pipeline=semi_sync"],
    "semi_sync/start_batch=5": ["pipeline=semi_sync", WARM],
    "semi_sync_stash/start_batch=5": ["pipeline=semi_sync_stash", WARM],
    "fused_sparse_dist": ["pipeline=fused_sparse_dist"],
    "sparse_dist/inplace_copy": ["pipeline=sparse_dist", "pipeline.tasks.h2d.options.inplace_copy=true"],
}
TORCHREC = {
    "torchrec_TrainPipelineSemiSync": ("TrainPipelineSemiSync", {"start_batch": 0, "stash_gradients": False}),
    "torchrec_TrainPipelineSemiSync/start_batch=5": (
        "TrainPipelineSemiSync",
        {"start_batch": 5, "stash_gradients": False},
    ),
    "torchrec_TrainPipelineSemiSync/start_batch=5/stash": (
        "TrainPipelineSemiSync",
        {"start_batch": 5, "stash_gradients": True},
    ),
    "torchrec_TrainPipelineFusedSparseDist": ("TrainPipelineFusedSparseDist", {}),
    "torchrec_TrainPipelineSparseDist/inplace_copy": ("TrainPipelineSparseDist", {"enable_inplace_copy_batch": True}),
}


def digest(params):
    return {k: hash(v.cpu().numpy().tobytes()) for k, v in params.items()}


def main():
    torch.use_deterministic_algorithms(True)
    info = init_distributed("cuda", "nccl")
    run = load_run(*COMMON, "pipeline=serial")
    loader = make_dataloader(run.data, info.rank, info.world_size)
    batches = list(loader)
    out = {"variants": {}, "loader_ids": [b.sample_ids.tolist() for b in batches]}
    for plan, overrides in PLANS.items():
        plan_run = load_run(*COMMON, *overrides)
        trainer = Trainer(build_parts(plan_run, training_plan(plan_run), info))
        try:
            summary = trainer.fit(iter(batches), record_steps=True)
            out["variants"][plan] = {
                "losses": summary.losses,
                "sample_ids": [ids.tolist() for ids in summary.sample_ids],
                "params": digest(local_parameters(trainer.state.model)),
            }
        finally:
            trainer.close()
    for name, (cls, options) in TORCHREC.items():
        model, opt = build_model(run, info, loader.dataset.spec)
        losses, ids = run_torchrec_pipeline(model, opt, info.device, batches, cls, **options)
        out["variants"][name] = {"losses": losses, "sample_ids": ids, "params": digest(local_parameters(model))}
    model, opt = build_model(run, info, loader.dataset.spec)
    losses, ids = run_stale_embedding_reference(model, opt, batches)
    out["variants"]["stale_reference"] = {
        "losses": losses,
        "sample_ids": ids,
        "params": digest(local_parameters(model)),
    }
    end_rank(os.path.join(sys.argv[1], f"rank{info.rank}.json"), out)


if __name__ == "__main__":
    main()
