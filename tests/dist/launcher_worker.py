"""Worker of the launcher tests: `recsys-train` runs of `model=dlrm_torch` (or the torchrec HSTU
model, `--model hstu_small`) through several plans, one after another in this process, with
`torch.use_deterministic_algorithms(True)`.

    python tests/dist/launcher_worker.py OUT.json --device cuda [--model M] [--block-torchrec] [--variants NAME ...]

Each variant is one run of the launcher exactly as `recsys-train <overrides>` runs it (config
validation, process group, run directory, Trainer, teardown), logging the loss every step; the
worker writes `{"variants": {name: {"exit_code", "losses", "placement"}}, "torchrec_imported", "device"}`
to OUT.json (`placement`: the run's "1 rank(s) on cuda:0 (nccl)").
`--block-torchrec` makes importing torchrec and fbgemm fail, as on the GPU machines. On CUDA the
host batches are pinned (`data.pin_memory=true`) so the copies are asynchronous.
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; before CUDA starts

VARIANTS = {
    "serial": ["pipeline=serial"],
    "sparse_dist": ["pipeline=sparse_dist"],  # pipelined, sequential executor
    "hstu_sparse_dist": ["pipeline=hstu_sparse_dist"],  # threaded, io/compute threads
    "hstu_prefetch": ["pipeline=hstu_prefetch"],  # threaded, prefetch context, 4 streams
    "hstu_prefetch/per_task": ["pipeline=hstu_prefetch", "thread_map=per_task"],
    "megatron/serial": ["pipeline=serial", "trainer.dense_ddp=megatron"],
    "megatron/hstu_prefetch": ["pipeline=hstu_prefetch", "trainer.dense_ddp=megatron"],
}
#: the model and the data it trains on
MODELS = {
    "dlrm_torch": ["model=dlrm_torch", "data=criteo_synthetic"],  # plain torch tables (DDP)
    "hstu_small": ["model=hstu_small", "data=synthetic"],  # torchrec tables (DMP, the input-dist tasks)
    # managed-collision tables (ids: managed, row-wise), evicting every 2 steps: DLRM's pooled ones on
    # its row-wise Adagrad (torchrec's eviction resets that state with fbgemm's CUDA kernel), HSTU's
    "dlrm_managed": [
        "model=dlrm",
        "data=criteo_synthetic",
        "data.ids=managed",
        "data.num_embeddings=64",
        "data.managed.eviction_interval=2",
        "model.sharding=row_wise",
    ],
    "hstu_managed": [
        "model=hstu_small",
        "data=synthetic",
        "data.ids=managed",
        "data.item_rows=64",
        "data.use_user_feature=true",
        "data.managed.eviction_policy=lru",
        "data.managed.eviction_interval=2",
        "model.sharding=row_wise",
    ],
}
#: what init_distributed sets for a plain process; cleared so each run makes its own group
GROUP_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def read_run(output_dir: Path) -> dict:
    """The per-step losses (metrics.jsonl) and where the run says it trained (train.log)."""
    run_dirs = list(output_dir.glob("recsys-train/*"))
    if len(run_dirs) != 1:
        return {"losses": [], "placement": None}
    records = [json.loads(line) for line in (run_dirs[0] / "metrics.jsonl").read_text().splitlines()]
    log = (run_dirs[0] / "train.log").read_text().splitlines()
    placement = next((line.split(" | ")[-1] for line in log if " rank(s) on " in line), None)
    return {"losses": [r["loss"] for r in records if "loss" in r], "placement": placement}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--model", choices=list(MODELS), default="dlrm_torch")
    parser.add_argument("--block-torchrec", action="store_true")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    if args.block_torchrec:
        for name in ("torchrec", "fbgemm_gpu"):
            sys.modules[name] = None  # `import torchrec` now fails
    import torch

    from recsys_pipe.cli.train import run

    torch.use_deterministic_algorithms(True)
    common = [
        *MODELS[args.model],
        "data.batch_size=64",
        f"data.num_batches={args.steps}",
        f"data.pin_memory={str(args.device == 'cuda').lower()}",
        "trainer.max_steps=null",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.progress_bar=false",
        f"trainer.device={args.device}",
    ]
    root = Path(args.out).parent / "runs"
    results = {}
    for name in args.variants:
        for key in GROUP_ENV:
            os.environ.pop(key, None)
        output_dir = root / name.replace("/", "_")
        code = run([*common, *VARIANTS[name], f"trainer.output_dir={output_dir}"])
        results[name] = {"exit_code": code, **read_run(output_dir)}
    report = {
        "variants": results,
        "torchrec_imported": any(m.split(".")[0] == "torchrec" and sys.modules[m] is not None for m in sys.modules),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
    }
    Path(args.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
