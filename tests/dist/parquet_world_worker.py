"""Worker for test_parquet_world_size: a `data=parquet` run checkpointed on one number of ranks
and resumed on another with the same global batch size (gloo, CPU).

`<out> <data> <nproc> <global batch> <steps> [<checkpoint>]`: trains DLRM on the Parquet files
`<data>` with `data.batch_size = <global batch> / <nproc>`, shuffled, up to step `<steps>` (a
checkpoint there), resumed from `<checkpoint>` if given; writes `<out>/rank<r>.json` with the
step it started at, the per-step sample ids this rank trained and the batches per epoch.
"""

import os
import sys

import torch

from recsys_pipe.runtime import init_distributed
from recsys_pipe.testing import built_trainer, end_rank
from recsys_pipe.train import resolve_resume

OVERRIDES = [
    "trainer=smoke",
    "model=dlrm",
    "data=parquet",
    "data.num_embeddings=64",
    "data.shuffle=true",
    "data.shuffle_window=64",
    "trainer.eval_every=0",
    "trainer.eval_batches=0",
    "trainer.tensorboard=false",
]


def main(out, data, nproc, global_batch, steps, checkpoint=None):
    info = init_distributed("cpu", "gloo")
    assert info.world_size == int(nproc)
    overrides = [
        *OVERRIDES,
        f"data.path={data}",
        f"data.batch_size={int(global_batch) // info.world_size}",
        f"trainer.max_steps={steps}",
        f"trainer.checkpoint.interval={steps}",
    ]
    with built_trainer(info, overrides, os.path.join(out, "run")) as trainer:
        if checkpoint is not None:
            trainer.restore(str(resolve_resume(checkpoint, "unused")))
        start = trainer.step
        summary = trainer.fit(record_steps=True)
    record = {
        "start": start,
        "sample_ids": [ids.tolist() for ids in summary.sample_ids],
        "batches_per_epoch": trainer.data.batches_per_epoch,
    }
    end_rank(os.path.join(out, f"rank{info.rank}.json"), record)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
