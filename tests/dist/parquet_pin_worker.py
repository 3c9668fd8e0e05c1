"""Worker for tests/cuda/test_cuda_parquet.py: the Parquet sources' batches pinned on CUDA.

Writes a small Criteo-layout Parquet directory and a sequence Parquet file into argv[1], reads
both with `data.pin_memory=true` and `data.num_workers` 0 and 1 (`make_dataloader`), and writes
argv[1]/pinned.json: per source and worker count, whether every tensor of the first batches is
pinned, and the batches' sample ids (the same with and without pinning). Then trains
`model=dlrm_torch` on the Parquet rows with pinned batches through the threaded prefetch plan on
`argv[2]` ("cuda", or "cpu" for the CPU smoke run) and records the per-step losses.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recsys_pipe.data import make_dataloader
from recsys_pipe.data.parquet.decode import item_vocab_metadata
from recsys_pipe.runtime import init_distributed, teardown
from recsys_pipe.testing import fit_run, load_run

BATCHES = 3


def write_files(out: Path) -> tuple[str, str]:
    rng = np.random.default_rng(0)
    n = 600
    cols = {"label": pa.array(rng.integers(0, 2, n).astype(np.int8))}
    cols |= {f"int_{i}": pa.array(rng.integers(0, 100, n)) for i in range(13)}
    cols |= {f"cat_{i}": pa.array(rng.integers(0, 2**20, n)) for i in range(26)}
    (out / "criteo").mkdir()
    pq.write_table(pa.table(cols), out / "criteo" / "a.parquet", row_group_size=100)
    seqs = [list(rng.integers(0, 60, rng.integers(4, 12))) for _ in range(80)]
    seq = pa.table({"user_id": pa.array(np.arange(80)), "item_ids": pa.array(seqs, pa.list_(pa.int64()))})
    meta = item_vocab_metadata(np.concatenate(seqs))
    pq.write_table(seq.replace_schema_metadata(meta), out / "seq.parquet", row_group_size=20)
    return str(out / "criteo"), str(out / "seq.parquet")


def tensors(value) -> list[torch.Tensor]:
    """Every tensor a batch holds (its fields, a KJT's values/lengths/offsets)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "_tensor_fields"):
        return [t for v in value._tensor_fields().values() for t in tensors(v)]
    found = []
    for name in ("_values", "_lengths", "_offsets", "_weights"):
        t = getattr(value, name, None)
        if isinstance(t, torch.Tensor):
            found.append(t)
    return found


def main() -> None:
    out, device = Path(sys.argv[1]), sys.argv[2]
    criteo, sequences = write_files(out)
    sources = {
        "parquet": ["data=parquet", f"data.path={criteo}", "model=dlrm_torch", "data.batch_size=32"],
        "parquet_sequences": [
            "data=parquet_sequences",
            f"data.path={sequences}",
            "model=sasrec",
            "data.batch_size=8",
            "data.eval_negatives=20",
        ],
    }
    report = {"pinned": {}, "same_batches": {}, "losses": []}
    for name, overrides in sources.items():
        ids = {}
        for workers in (0, 1):
            for pin in (False, True):
                run = load_run(*overrides, f"data.num_workers={workers}", f"data.pin_memory={str(pin).lower()}")
                batches = []
                for batch in make_dataloader(run.data, 0, 1):
                    batches.append(batch)
                    if len(batches) == BATCHES:
                        break
                found = [t for b in batches for t in tensors(b)]
                ids[(workers, pin)] = [b.sample_ids.tolist() for b in batches]
                if pin:
                    # an empty tensor has no memory, so CUDA never calls it pinned (and copies nothing)
                    held = [t for t in found if t.numel()]
                    report["pinned"][f"{name}/workers={workers}"] = bool(held) and all(t.is_pinned() for t in held)
        report["same_batches"][name] = len({json.dumps(v) for v in ids.values()}) == 1
    common = ["trainer=smoke", "trainer.max_steps=6", "trainer.eval_every=0", "trainer.tensorboard=false"]
    overrides = [*sources["parquet"], "pipeline=hstu_prefetch", "data.pin_memory=true"]
    overrides += ["data.num_workers=1", f"trainer.device={device}", *common]
    info = init_distributed(device)  # a plain process: a 1-rank group (NCCL on CUDA)
    try:
        report["losses"] = fit_run(info, overrides).losses
    finally:
        teardown()
    (out / "pinned.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
