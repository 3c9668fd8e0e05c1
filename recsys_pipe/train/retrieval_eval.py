"""Next-item retrieval evaluation, distributed over the ranks: ranks, HR@K, NDCG@K, MRR.

Every rank scores its own users of the validation and test splits (`SequencesDataset.split`)
through the evaluation pipeline (the training plan with the optimizer work switched off); the
model returns, per user, the 0-based rank of the held-out item (the number of candidates scored
strictly above it) under two protocols:

* `sampled` (SASRec's): among the held-out item and `data.eval_negatives` items sampled
  uniformly from those the user never interacted with (seeded per user);
* `full` (HSTU's): among every item of the catalogue, the user's own history included.

The ranks are gathered to every rank; metrics for K in `KS`:
`HR@K = mean(rank < K)`, `NDCG@K = mean(1 / log2(rank + 2) if rank < K else 0)` (one relevant
item, so the ideal DCG is 1), `MRR = mean(1 / (rank + 1))`. torchmetrics' retrieval metrics
compute the same from scores (tests check that); here ranks are what the model hands back and
what the dump records, so the metrics are computed from them directly.

`trainer.eval_dump=<file.csv>` (rank 0) writes, whenever the validation HR@10 improves on every
earlier evaluation of the run, the test split's rows `user,item,rank_sampled,rank_full` (raw
user and held-out item ids as written in the input file; `rank_full` -1 without `data.full_eval`):
the test ranks of the evaluation that validation picks.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.data.loader import RankData, has_eval_splits
from recsys_pipe.data.sequences import SPLITS, SequencesDataset

__all__ = ["KS", "PROTOCOLS", "RetrievalEvaluation", "retrieval_metrics"]

log = logging.getLogger(__name__)

KS = (10, 50, 200)
PROTOCOLS = ("sampled", "full")
#: the validation metric that picks the evaluation whose test ranks are dumped
SELECTION = ("valid", "sampled", "HR@10")


def retrieval_metrics(ranks: torch.Tensor, ks: tuple[int, ...] = KS) -> dict[str, float]:
    """HR@K, NDCG@K (K in `ks`) and MRR of one relevant item per query.

    Args:
        ranks: `[queries]` 0-based rank of each query's relevant item among its scored items.
        ks: the cut-offs K.

    Returns:
        `{"HR@K": ..., "NDCG@K": ..., "MRR": ...}`, each averaged over the queries."""
    ranks = ranks.double()
    out: dict[str, float] = {}
    for k in ks:
        hit = ranks < k
        out[f"HR@{k}"] = float(hit.double().mean())
        out[f"NDCG@{k}"] = float(torch.where(hit, 1.0 / torch.log2(ranks + 2), torch.zeros_like(ranks)).mean())
    out["MRR"] = float((1.0 / (ranks + 1)).mean())
    return out


class RetrievalEvaluation:
    """Evaluation of a retrieval run: this rank's loaders of both splits, the gather, the dump.

    `RetrievalEvaluation.of(data, ...)` is None for a dataset without evaluation splits.
    """

    def __init__(self, dataset: SequencesDataset, batch_size: int, world_size: int, dump: str | None) -> None:
        self.dataset = dataset
        self.world_size = world_size
        self.dump = dump
        self.best: float | None = None
        self.loaders = {}
        for name in SPLITS:
            split = dataset.split(name, batch_size)
            self.loaders[name] = DataLoader(split, batch_size=batch_size, shuffle=False, collate_fn=split.collate)

    @classmethod
    def of(cls, data: RankData, world_size: int, dump: str | None, is_main: bool) -> RetrievalEvaluation | None:
        """The evaluation of this rank's share of a retrieval data source.

        Args:
            data: this rank's data (its dataset decides whether there are evaluation splits).
            world_size: the number of ranks whose results are gathered.
            dump: `trainer.eval_dump`, a file to write every scored user to, or None.
            is_main: whether this is rank 0 (the one that writes the dump).

        Returns:
            The evaluation, or None for a dataset without evaluation splits (ConfigError when a dump
            is asked of one)."""
        if not has_eval_splits(data.dataset):
            if dump is not None:
                raise ConfigError(
                    ConfigProblem(
                        "trainer.eval_dump", f"data source '{data.cfg.label}' has no retrieval evaluation to dump"
                    )
                )
            return None
        batch_size = data.cfg.eval_batch_size or data.cfg.batch_size
        return cls(data.dataset, batch_size, world_size, dump if is_main else None)

    def evaluate(self, pipeline: Any) -> dict[str, Any]:
        """`{split: {protocol: {metric: value}}, "users": {split: count}}` over all ranks; runs
        `pipeline.iterate` over each split's batches."""
        record: dict[str, Any] = {"users": {}}
        ranks_by_split = {}
        for name, loader in self.loaders.items():
            ids, sampled, full = [], [], []
            for result in pipeline.iterate(loader):
                ids.append(result.sample_ids.cpu())
                sampled.append(result.outputs["rank_sampled"].cpu())
                full.append(result.outputs["rank_full"].cpu())
            table = torch.stack([torch.cat(ids), torch.cat(sampled), torch.cat(full)])
            table = self._gather(table)
            table = table[:, table[0] >= 0]  # drop the padding
            table = table[:, torch.argsort(table[0])]
            ranks_by_split[name] = table
            record["users"][name] = int(table.shape[1])
            record[name] = {"sampled": retrieval_metrics(table[1])}
            if bool((table[2] >= 0).all()) and table.shape[1]:
                record[name]["full"] = retrieval_metrics(table[2])
        score = record[SELECTION[0]][SELECTION[1]][SELECTION[2]]
        if self.best is None or score > self.best:
            self.best = score
            record["selected"] = True
            if self.dump is not None:
                self._write_dump(ranks_by_split["test"])
        return record

    def _gather(self, table: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1 or not dist.is_initialized():
            return table
        parts = [torch.empty_like(table) for _ in range(self.world_size)]
        dist.all_gather(parts, table)  # same size on every rank: splits are padded alike
        return torch.cat(parts, dim=1)

    def _write_dump(self, table: torch.Tensor) -> None:
        ds = self.dataset
        tmp = f"{self.dump}.tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["user", "item", "rank_sampled", "rank_full"])
            for user, rank_sampled, rank_full in table.T.tolist():
                item = ds.raw_items[ds.held_out(user, "test")]
                writer.writerow([ds.raw_users[user], item, rank_sampled, rank_full])
        os.replace(tmp, self.dump)  # readers never see a half-written file

    @staticmethod
    def describe(record: Mapping[str, Any]) -> str:
        """One log line of an evaluation record."""
        parts = []
        for split in SPLITS:
            for protocol in PROTOCOLS:
                m = record.get(split, {}).get(protocol)
                if m:
                    parts.append(f"{split}/{protocol} HR@10 {m['HR@10']:.4f} NDCG@10 {m['NDCG@10']:.4f}")
        return "; ".join(parts)
