"""Worker for test_parquet_world_size: a `data=parquet` run checkpointed on one number of ranks
and resumed on another with the same global batch size (gloo, CPU).

`<out> <data> <nproc> <global batch> <steps> [<checkpoint>]`: trains DLRM on the Parquet files
`<data>` with `data.batch_size = <global batch> / <nproc>`, shuffled, up to step `<steps>` (a
checkpoint there), resumed from `<checkpoint>` if given; writes `<out>/rank<r>.json` with the
step it started at, the per-step sample ids this rank trained and the batches per epoch.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from recsys_pipe.runtime import init_distributed
from recsys_pipe.testing import load_run
from recsys_pipe.train import Trainer, build_parts, resolve_resume, training_plan


def main(out, data, nproc, global_batch, steps, checkpoint=None):
    info = init_distributed("cpu", "gloo")
    assert info.world_size == int(nproc)
    run = load_run(
        "trainer=smoke",
        "model=dlrm",
        "data=parquet",
        f"data.path={data}",
        "data.num_embeddings=64",
        f"data.batch_size={int(global_batch) // info.world_size}",
        "data.shuffle=true",
        "data.shuffle_window=64",
        "trainer.eval_every=0",
        "trainer.eval_batches=0",
        "trainer.tensorboard=false",
        f"trainer.max_steps={steps}",
        f"trainer.checkpoint.interval={steps}",
    )
    run_dir = os.path.join(out, "run")
    if info.is_main:
        os.makedirs(run_dir, exist_ok=True)
    dist.barrier()
    trainer = Trainer(build_parts(run, training_plan(run), info, run_dir))
    try:
        if checkpoint is not None:
            trainer.restore(str(resolve_resume(checkpoint, "unused")))
        start = trainer.step
        summary = trainer.fit(record_steps=True)
    finally:
        trainer.close()
    with open(os.path.join(out, f"rank{info.rank}.json"), "w") as f:
        record = {
            "start": start,
            "sample_ids": [ids.tolist() for ids in summary.sample_ids],
            "batches_per_epoch": trainer.data.batches_per_epoch,
        }
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
