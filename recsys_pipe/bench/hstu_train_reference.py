"""Train generative-recommenders' research HSTU (a clone: `--reference PATH` or
`$RECSYS_HSTU_REFERENCE`) on a sequences file with its own recipe, and evaluate it under this
project's protocols, so that its figures sit next to ours in `recsys-bench retrieval_report`.

Training is the step of the reference's `trainer/train.py` (its `HSTU`, `SampledSoftmaxLoss` with
`LocalNegativesSampler`, AdamW lr 1e-3, betas (0.9, 0.98), no weight decay) on this project's
training samples (`data=sequences`: the same users, split and truncation; the users shuffled
every epoch). Every `--eval-epochs` epochs, both splits are ranked as `recsys-train` ranks them
(`recsys_pipe.models.retrieval`): the last position's vector against the held-out item and its
100 sampled negatives, and against every item (no exclusion of the history), the reference's
item vectors L2-normalised as its evaluation normalises them. The run directory gets what
`recsys-train` writes for the report: `metrics.jsonl` (one record per evaluation, the one with
the best validation HR@10 so far `selected`), `train.log` (steps per epoch, samples/s) and
`train_seconds`.

    python -m recsys_pipe.bench.hstu_train_reference --data Video.txt --out runs/games/hstu_reference \\
        [--epochs 60] [--eval-epochs 5] [--max-steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from recsys_pipe.bench.hstu import REFERENCE_ENV, Sizes, build_reference, load_reference, reference_forward
from recsys_pipe.bench.hstu import reference_inputs as training_inputs
from recsys_pipe.data.batch import collate_retrieval
from recsys_pipe.data.in_memory.sequences import SequencesDataConfig, SequencesDataset
from recsys_pipe.data.source import SPLITS
from recsys_pipe.train.retrieval_eval import SELECTION, retrieval_metrics


def reference_ranks(ref, dataset: SequencesDataset, split: str, attn_len: int, batch: int = 512) -> dict:
    """Per evaluated user of `split`, the held-out item's 0-based rank under each protocol
    (`{"sampled": [U], "full": [U]}`), as `recsys-train` ranks them: the reference's vector of
    the last position (its times carrying the held-out item's, as its own evaluation does)
    against the held-out item and its sampled negatives, and against every item, its item
    vectors L2-normalised as its evaluation normalises them."""
    model, sampler = ref.model, ref.sampler
    model.eval()
    users = [u for u, seq in enumerate(dataset.sequences) if len(seq) >= 3]
    ranks: dict[str, list[torch.Tensor]] = {"sampled": [], "full": []}
    with torch.no_grad():
        items = sampler.normalize_embeddings(model.get_item_embeddings(torch.arange(1, dataset.num_items + 1)))
        for start in range(0, len(users), batch):
            samples = [dataset.eval_sample(u, split) for u in users[start : start + batch]]
            b = len(samples)
            lengths = torch.tensor([len(s.inputs) for s in samples])
            ids = torch.zeros(b, attn_len, dtype=torch.int64)
            stamps = torch.zeros(b, attn_len, dtype=torch.int64)
            for i, s in enumerate(samples):
                ids[i, : len(s.inputs)] = torch.tensor(s.inputs) + 1
                stamps[i, : len(s.inputs)] = torch.tensor(s.timestamps)
                stamps[i, len(s.inputs)] = s.target_timestamp  # as its movielens_seq_features_from_row
            query = model.encode(
                past_lengths=lengths,
                past_ids=ids,
                past_embeddings=model.get_item_embeddings(ids),
                past_payloads={"timestamps": stamps},
            )
            full = query @ items.T  # [B, num_items]
            cand = full.gather(1, torch.tensor([s.candidates for s in samples]))
            ranks["sampled"].append((cand[:, 1:] > cand[:, :1]).sum(dim=1))
            ranks["full"].append((full > cand[:, :1]).sum(dim=1))
    model.train()
    return {protocol: torch.cat(r) for protocol, r in ranks.items()}


def evaluate(ref, dataset: SequencesDataset, split: str, attn_len: int) -> dict:
    """Both protocols' metrics of `split` (`reference_ranks`), and the number of users."""
    ranks = reference_ranks(ref, dataset, split, attn_len)
    return {protocol: retrieval_metrics(r) for protocol, r in ranks.items()} | {"users": len(ranks["full"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help='"user item" or MovieLens ratings file')
    parser.add_argument("--reference", default=os.environ.get(REFERENCE_ENV), help="clone of generative-recommenders")
    parser.add_argument("--out", required=True, help="run directory (metrics.jsonl, train.log, train_seconds)")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--eval-epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (timing runs)")
    parser.add_argument("--data-len", type=int, default=50, help="most recent items of a sequence")
    parser.add_argument("--dim", type=int, default=50)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--negatives", type=int, default=128)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42, help="the reference's random_seed")
    args = parser.parse_args()
    if not args.reference:
        parser.error(f"--reference PATH (or ${REFERENCE_ENV}) is required")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    sizes = Sizes(args.data_len, args.dim, args.blocks, args.heads, args.negatives, args.batch, args.dropout)
    dataset = SequencesDataConfig(path=args.data, max_seq_len=sizes.data_len).dataset(0, 1)
    ref = build_reference(load_reference(args.reference), sizes, dataset.num_items)
    ref.model.train()
    optimizer = torch.optim.AdamW(ref.model.parameters(), lr=sizes.lr, betas=(0.9, 0.98), weight_decay=0.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per_epoch = len(dataset) // sizes.batch
    log = (out / "train.log").open("w")
    log.write(f"epoch 1/{args.epochs} done at step {per_epoch}\n")  # the report's steps per epoch
    metrics = (out / "metrics.jsonl").open("w")
    best, step, start = -1.0, 0, time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed + epoch))
        window, window_start = 0, time.perf_counter()
        for b in range(per_epoch):
            samples = [dataset[int(i)] for i in order[b * sizes.batch : (b + 1) * sizes.batch]]
            optimizer.zero_grad()
            _, loss = reference_forward(ref, training_inputs(collate_retrieval(samples), sizes.attn_len))
            loss.backward()
            optimizer.step()
            step, window = step + 1, window + 1
            if step % 100 == 0 or step == args.max_steps:
                rate = window * sizes.batch / (time.perf_counter() - window_start)
                log.write(f"step {step} | loss {loss.item():.4f} | {rate:.1f} samples/s |\n")
                log.flush()
                window, window_start = 0, time.perf_counter()
            if step == args.max_steps:
                break
        last = epoch == args.epochs - 1 or step == args.max_steps
        if (epoch + 1) % args.eval_epochs == 0 or last:
            record: dict = {"step": step, "epoch": epoch + 1}
            for split in SPLITS:
                result = evaluate(ref, dataset, split, sizes.attn_len)
                record[split] = {p: result[p] for p in ("sampled", "full")}
                record.setdefault("users", {})[split] = result["users"]
            value = record[SELECTION[0]][SELECTION[1]][SELECTION[2]]
            record["selected"] = value > best
            best = max(best, value)
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            print(
                f"epoch {epoch + 1}: valid HR@10 {value:.4f}, test {record['test']['sampled']['HR@10']:.4f}", flush=True
            )
        if last:
            break
    (out / "train_seconds").write_text(str(round(time.perf_counter() - start)))


if __name__ == "__main__":
    main()
