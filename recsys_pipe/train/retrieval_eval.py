"""Next-item retrieval evaluation, distributed over the ranks: ranks, HR@K, NDCG@K, MRR.

Every rank scores its own users of the validation and test splits (`dataset.split(name,
batch_size)` of a source with its own splits: `data=sequences`, `data=parquet_sequences`)
through the evaluation plan runner (the training plan with the optimizer work switched off); the
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

`trainer.eval_dump=<file.csv>` (rank 0; a relative path inside the run directory) writes,
whenever the validation HR@10 improves on every earlier evaluation of the run, the test split's
rows `user,item,rank_sampled,rank_full` (raw user and held-out item ids as written in the input
file; `rank_full` -1 without `data.full_eval`): the test ranks of the evaluation that validation
picks.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Mapping
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.data.source import SPLITS, RankData, has_eval_splits

__all__ = ["KS", "PROTOCOLS", "RetrievalEvaluation", "check_eval_dump", "eval_dump_path", "retrieval_metrics"]

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


def check_eval_dump(dump: str | None, eval_every: int, data: RankData) -> None:
    """ConfigError at `trainer.eval_dump` for a dump that would not be written: a data source
    without retrieval evaluation, evaluation turned off (`trainer.eval_every=0`), or an absolute
    path in a missing directory or naming a directory. Run by the pre-flight of `recsys-train`
    (and `--check`) before anything starts. A relative path is taken inside the run directory
    (`eval_dump_path`), which the run creates."""
    if dump is None:
        return
    _check_dump_source(dump, data)

    def refuse(message: str) -> NoReturn:
        raise ConfigError(ConfigProblem("trainer.eval_dump", message))

    if eval_every == 0:
        refuse(
            "nothing would be written: trainer.eval_every=0 turns evaluation off and the dump is written at "
            "evaluations; set trainer.eval_every > 0 or drop trainer.eval_dump"
        )
    if not os.path.isabs(dump):
        return
    if os.path.isdir(dump):
        refuse(f"{dump} is a directory; trainer.eval_dump names the CSV file to write")
    folder = os.path.dirname(dump)
    if not os.path.isdir(folder):
        refuse(f"no such directory: {folder} (a relative path is written inside the run directory)")
    if not os.access(folder, os.W_OK):
        refuse(f"cannot write into {folder}")


def eval_dump_path(dump: str | None, run_dir: str) -> str | None:
    """Where the dump is written: an absolute `trainer.eval_dump` as it is, a relative one inside
    the run directory (so that the jobs of a sweep never overwrite each other's dump)."""
    if dump is None:
        return None
    return dump if os.path.isabs(dump) else os.path.abspath(os.path.join(run_dir, dump))


def _check_dump_source(dump: str | None, data: RankData) -> None:
    if dump is not None and not has_eval_splits(data.dataset):
        raise ConfigError(
            ConfigProblem("trainer.eval_dump", f"data source '{data.cfg.label}' has no retrieval evaluation to dump")
        )


class RetrievalEvaluation:
    """Evaluation of a retrieval run: this rank's loaders of both splits, the gather, the dump.

    `RetrievalEvaluation.of(data, ...)` is None for a dataset without evaluation splits.
    """

    def __init__(
        self, dataset: Any, batch_size: int, world_size: int, dump: str | None, replica_ranks: int = 1
    ) -> None:
        self.dataset = dataset
        self.world_size = world_size
        #: ranks per data-parallel replica (`Parallelism.ranks_per_replica`): they score the same users
        self.replica_ranks = replica_ranks
        self.dump = dump
        self.best: float | None = None
        self.loaders = {}
        for name in SPLITS:
            split = dataset.split(name, batch_size)
            self.loaders[name] = DataLoader(split, batch_size=batch_size, shuffle=False, collate_fn=split.collate)

    @classmethod
    def of(
        cls, data: RankData, world_size: int, dump: str | None, is_main: bool, replica_ranks: int = 1
    ) -> RetrievalEvaluation | None:
        """The evaluation of this rank's share of a retrieval data source.

        Args:
            data: this rank's data (its dataset decides whether there are evaluation splits).
            world_size: the number of ranks whose results are gathered.
            dump: `trainer.eval_dump`, a file to write every scored user to, or None.
            is_main: whether this is rank 0 (the one that writes the dump).
            replica_ranks: the ranks of one data-parallel replica (`Parallelism.ranks_per_replica`),
                which all hold their replica's ranks of the users.

        Returns:
            The evaluation, or None for a dataset without evaluation splits (ConfigError when a dump
            is asked of one)."""
        if not has_eval_splits(data.dataset):
            _check_dump_source(dump, data)
            return None
        batch_size = data.cfg.eval_batch_size or data.cfg.batch_size
        return cls(data.dataset, batch_size, world_size, dump if is_main else None, replica_ranks)

    def evaluate(self, runner: Any) -> dict[str, Any]:
        """`{split: {protocol: {metric: value}}, "users": {split: count}}` over all ranks; runs
        `runner.iterate` over each split's batches."""
        record: dict[str, Any] = {"users": {}}
        ranks_by_split = {}
        for name, loader in self.loaders.items():
            ids, sampled, full = [], [], []
            for result in runner.iterate(loader):
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
        # one rank per replica: ranks 0..replicas-1 are one rank of each replica
        return torch.cat(parts[: self.world_size // self.replica_ranks], dim=1)

    def _write_dump(self, table: torch.Tensor) -> None:
        ds = self.dataset
        os.makedirs(os.path.dirname(os.path.abspath(self.dump)), exist_ok=True)  # a relative path's folders
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
