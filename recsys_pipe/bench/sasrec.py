"""SASRec training throughput: recsys_pipe's trainer against the reference PyTorch implementation
(pmixer/SASRec.pytorch, whose `python/model.py` a user downloads with the repository), side by
side on the same machine, the same data and the same model sizes.

Both train `--steps` batches of 128 users (width 50, 2 pre-LN blocks, 1 head, dropout 0.5, max
length 50, BCE with one negative per position, Adam with betas (0.9, 0.98) on every weight, the
item table included: ours on torchrec's dense kernel) in one process with `--threads` intra-op threads;
repetitions alternate between the two so that load on the machine hits both alike. The
reference trains on the same samples, left-padded as its own sampler pads them (the time of its
multi-process sampler is not counted; ours includes the data loader). Prints samples/s of each,
median (min-max), and the ratio ours / reference, by the wall clock and by the process's CPU
clock (samples per CPU-second: on a machine shared with other jobs it varies far less; with one
thread the two agree on an idle machine).

`--levers` also trains ours with each speed lever switched back to torch's stock path, to
measure what each one saves: `mask` (dropout masks by `bernoulli_` instead of `keep_mask`),
`fused_adam` (Adam's per-parameter loop instead of the fused kernel), and both.

    recsys-bench sasrec --data Video.txt --reference SASRec.pytorch/python [--levers]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

from recsys_pipe.bench.common import sequences_train_speed, summary
from recsys_pipe.runtime import init_distributed
from recsys_pipe.train.optim import AdamConfig

MAX_LEN, BATCH = 50, 128


def bernoulli_dropout(x: torch.Tensor, p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Dropout as `F.dropout` draws it on the CPU (`bernoulli_`): the `mask` lever switched off."""
    if p == 0:
        return x
    return x * torch.empty_like(x).bernoulli_(1 - p, generator=generator).div_(1 - p)


def loop_adam(cfg: AdamConfig, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """`optimizer=adam` on torch's per-parameter loop (its CPU default): the `fused_adam` lever switched off."""
    return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


#: the variants `--levers` trains: name -> the levers switched off
LEVERS_OFF = {
    "all levers": (),
    "no mask": ("mask",),
    "no fused_adam": ("fused_adam",),
    "neither": ("mask", "fused_adam"),
}


@contextlib.contextmanager
def levers_off(names: tuple[str, ...]) -> Iterator[None]:
    """Within the block, the levers `names` use torch's stock path (module attributes patched)."""
    with contextlib.ExitStack() as stack:
        if "mask" in names:
            stack.enter_context(mock.patch("recsys_pipe.models.dropout.dropout", bernoulli_dropout))
        if "fused_adam" in names:
            stack.enter_context(mock.patch("recsys_pipe.train.optim.build_adam", loop_adam))
        yield


def ours(data: str, steps: int, info) -> tuple[float, float]:
    """Samples/s of recsys_pipe's trainer on the reference's configuration (serial plan, `steps`
    steps), by the wall clock and by the CPU clock."""
    return sequences_train_speed(
        data,
        steps,
        info,
        "model=sasrec",
        "model.norm_first=true",
        "model.compute_kernel=dense",  # Adam updates the item table, as in the reference
        "optimizer.betas=[0.9,0.98]",
    )


def reference_batches(data: str, steps: int) -> list[tuple[np.ndarray, ...]]:
    """The reference's (user, seq, pos, neg) arrays for the first `steps` batches of our training
    samples (ids + 1: the reference keeps 0 for padding)."""
    from recsys_pipe.data.in_memory.sequences import SequencesDataConfig

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


def reference_model_class(model_dir: str) -> type:
    """The `SASRec` class of the reference implementation's `model_dir/model.py`, loaded from that
    file by path (it is no package, and the import path stays as it is)."""
    path = Path(model_dir) / "model.py"
    if not path.is_file():
        raise SystemExit(f"error: --reference: no model.py in {model_dir}")
    spec = importlib.util.spec_from_file_location("sasrec_reference_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SASRec


def reference(model_dir: str, num_users: int, num_items: int, batches) -> tuple[float, float]:
    """Samples/s of the reference implementation training `batches` (its own loop and
    optimiser), by the wall clock and by the CPU clock."""
    SASRec = reference_model_class(model_dir)

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
    start, cpu = time.perf_counter(), time.process_time()
    for users, seq, pos, neg in batches:
        pos_logits, neg_logits = model(users, seq, pos, neg)
        indices = np.where(pos != 0)
        optimizer.zero_grad()
        loss = bce(pos_logits[indices], torch.ones_like(pos_logits[indices]))
        loss = loss + bce(neg_logits[indices], torch.zeros_like(neg_logits[indices]))
        loss.backward()
        optimizer.step()
    samples = len(batches) * BATCH
    return samples / (time.perf_counter() - start), samples / (time.process_time() - cpu)


def main() -> None:
    """Alternate the implementations `--reps` times; print samples/s and the ratios, then one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help='"user item" file, e.g. Video.txt')
    parser.add_argument("--reference", required=True, help="directory of the reference implementation's model.py")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--levers", action="store_true", help="also train ours with each speed lever switched off")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info = init_distributed("cpu", "gloo")
    from recsys_pipe.data.in_memory.sequences import SequencesDataConfig

    dataset = SequencesDataConfig(path=args.data).dataset(0, 1)
    batches = reference_batches(args.data, args.steps)
    variants = LEVERS_OFF if args.levers else {"ours": ()}
    names = [*variants, "reference"]
    results: dict[str, dict[str, list[float]]] = {clock: {name: [] for name in names} for clock in ("wall", "cpu")}
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:  # the order rotates
            if name == "reference":
                speeds = reference(args.reference, dataset.num_users, dataset.num_items, batches)
            else:
                with levers_off(variants[name]):
                    speeds = ours(args.data, args.steps, info)
            for clock, value in zip(("wall", "cpu"), speeds):
                results[clock][name].append(value)
    report: dict = {"steps": args.steps, "reps": args.reps, "threads": args.threads}
    for clock, table in results.items():
        report[clock] = {}
        for name, values in table.items():
            entry = report[clock][name] = {"samples_per_s": summary(values, 1), "values": [round(v, 1) for v in values]}
            for base in ("reference", "neither"):  # paired ratios, repetition by repetition
                if name not in ("reference", base) and base in table:
                    entry[f"over_{base}"] = summary(a / b for a, b in zip(values, table[base]))
        print(f"-- {clock} clock")
        for name, r in report[clock].items():
            s = r["samples_per_s"]
            line = f"{name:14} {s['median']:8.1f} samples/s ({s['min']}-{s['max']})"
            for base in ("reference", "neither"):
                if f"over_{base}" in r:
                    o = r[f"over_{base}"]
                    line += f"  / {base} {o['median']:.3f} ({o['min']}-{o['max']})"
            print(line)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
