"""SASRec training throughput: recsys_pipe's trainer against the reference PyTorch implementation
(pmixer/SASRec.pytorch, whose `python/model.py` a user downloads with the repository), side by
side on the same machine, the same data and the same model sizes.

Both train `--steps` batches of 128 users (width 50, 2 pre-LN blocks, 1 head, dropout 0.5, max
length 50, BCE with one negative per position, Adam with betas (0.9, 0.98) on every weight, the
item table included: ours on torchrec's dense kernel) in one process with `--threads` intra-op threads;
repetitions alternate between the two so that load on the machine hits both alike. The
reference trains on the same samples, left-padded as its own sampler pads them (the time of its
multi-process sampler is not counted; ours includes the data loader). Prints samples/s of each,
median (min-max), and the ratio ours / reference.

    python scripts/bench_sasrec.py --data Video.txt --reference SASRec.pytorch/python
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import summary

from recsys_pipe.runtime import init_distributed
from recsys_pipe.testing import load_run
from recsys_pipe.train import Trainer, training_plan

MAX_LEN, BATCH = 50, 128


def ours(data: str, steps: int, info) -> float:
    run = load_run(
        "data=sequences",
        f"data.path={data}",
        "model=sasrec",
        "pipeline=serial",
        "model.norm_first=true",
        "model.sharding=row_wise",
        "model.compute_kernel=dense",  # Adam updates the item table, as in the reference
        "optimizer.betas=[0.9,0.98]",
        "trainer.device=cpu",
        f"trainer.max_steps={steps}",
        "trainer.eval_every=0",
        "trainer.progress_bar=false",
        f"trainer.log_every={steps}",
    )
    trainer = Trainer(run, training_plan(run), info)
    try:
        return trainer.fit().samples_per_s
    finally:
        trainer.close()


def reference_batches(data: str, steps: int) -> list[tuple[np.ndarray, ...]]:
    """The reference's (user, seq, pos, neg) arrays for the first `steps` batches of our training
    samples (ids + 1: the reference keeps 0 for padding)."""
    from recsys_pipe.data.sequences import SequencesDataConfig

    dataset = SequencesDataConfig(path=data).dataset(0, 1)
    batches = []
    for b in range(steps):
        arrays = [np.zeros((BATCH, MAX_LEN), dtype=np.int64) for _ in range(3)]
        users = np.zeros(BATCH, dtype=np.int64)
        for i in range(BATCH):
            sample = dataset[(b * BATCH + i) % len(dataset)]
            users[i] = sample.sample_id + 1
            for array, ids in zip(arrays, (sample.inputs, sample.targets, sample.negatives)):
                array[i, MAX_LEN - len(ids) :] = np.asarray(ids) + 1
        batches.append((users, *arrays))
    return batches


def reference(model_dir: str, num_users: int, num_items: int, batches) -> float:
    sys.path.insert(0, model_dir)
    from model import SASRec  # the reference implementation's module

    args = SimpleNamespace(
        device="cpu", hidden_units=50, maxlen=MAX_LEN, dropout_rate=0.5, num_blocks=2, num_heads=1, norm_first=True
    )
    model = SASRec(num_users, num_items, args)
    for param in model.parameters():  # the reference's own initialisation
        try:
            torch.nn.init.xavier_normal_(param.data)
        except ValueError:
            pass
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    bce = torch.nn.BCEWithLogitsLoss()
    start = time.perf_counter()
    for users, seq, pos, neg in batches:
        pos_logits, neg_logits = model(users, seq, pos, neg)
        indices = np.where(pos != 0)
        optimizer.zero_grad()
        loss = bce(pos_logits[indices], torch.ones_like(pos_logits[indices]))
        loss = loss + bce(neg_logits[indices], torch.zeros_like(neg_logits[indices]))
        loss.backward()
        optimizer.step()
    return len(batches) * BATCH / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help='"user item" file, e.g. Video.txt')
    parser.add_argument("--reference", required=True, help="directory of the reference implementation's model.py")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info = init_distributed("cpu", "gloo")
    from recsys_pipe.data.sequences import SequencesDataConfig

    dataset = SequencesDataConfig(path=args.data).dataset(0, 1)
    batches = reference_batches(args.data, args.steps)
    results: dict[str, list[float]] = {"ours": [], "reference": []}
    for _ in range(args.reps):
        results["ours"].append(ours(args.data, args.steps, info))
        results["reference"].append(reference(args.reference, dataset.num_users, dataset.num_items, batches))
    ratios = [a / b for a, b in zip(results["ours"], results["reference"])]
    report = {
        "samples_per_s": {name: summary(values, 1) for name, values in results.items()},
        "ratio_ours_over_reference": summary(ratios),
        "steps": args.steps,
        "reps": args.reps,
        "threads": args.threads,
    }
    for name, s in report["samples_per_s"].items():
        print(f"{name:10} {s['median']:8.1f} samples/s ({s['min']}-{s['max']})")
    r = report["ratio_ours_over_reference"]
    print(f"ours / reference: {r['median']:.3f} ({r['min']}-{r['max']})")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
