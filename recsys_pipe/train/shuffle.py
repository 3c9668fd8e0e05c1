"""The balanced batch shuffler: before a batch is trained, move samples between ranks so every
rank's share costs about the same.

With variable-length sequences and attention cost quadratic in length, ranks that drew long
sequences take longer per step and the others wait for them at every collective. The shuffler
runs as two plan tasks on each batch, right after it reaches the device:

* `start_shuffle` all-gathers the per-sample costs (the model's workload model,
  `ModelConfig.sample_costs`) and submits the partition solve to a background thread;
* `finish_shuffle` waits for that solve (the future of this same batch), all-gathers the
  ranks' batches and keeps the samples assigned to this rank.

Every rank solves the same problem on the same gathered costs with a deterministic algorithm, so
they agree on the assignment without another exchange. The partition keeps each rank's batch
size: samples are only exchanged, every sample is trained exactly once, by one rank.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BalanceStats", "BatchBalancer", "ShufflePlan", "assign_to_ranks", "karmarkar_karp", "solve_shuffle"]


def karmarkar_karp(costs: Sequence[float], num_parts: int) -> list[list[int]]:
    """Partition the indices of `costs` into `num_parts` parts of equal size with nearly equal
    cost sums: the Karmarkar-Karp largest-differencing method, balanced variant.

    Sorted by cost, each run of `num_parts` consecutive items starts as a partial solution of
    singleton parts. Repeatedly the two partial solutions with the largest spread (max - min part
    sum) are merged, pairing the lightest part of one with the heaviest of the other, until one
    is left. Every merge adds one item per part, so all parts end the same size.

    Hand-written: `numberpartitioning` (the maintained package implementing Karmarkar-Karp)
    has no equal-cardinality variant, and each rank must keep its batch size. Deterministic
    (ties broken by index), so every rank computes the same partition.

    Returns the parts' indices, each sorted, parts ordered by cost sum.
    """
    n = len(costs)
    if num_parts < 1 or n % num_parts:
        raise ValueError(f"{n} items cannot be split into {num_parts} parts of equal size")
    order = sorted(range(n), key=lambda i: (costs[i], i))
    heap: list[tuple[float, int, list[tuple[float, int, list[int]]]]] = []
    counter = itertools.count()
    for start in range(0, n, num_parts):
        parts = sorted((costs[i], i, [i]) for i in order[start : start + num_parts])
        heapq.heappush(heap, (-(parts[-1][0] - parts[0][0]), next(counter), parts))
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        merged = sorted((sa + sb, min(ka, kb), ma + mb) for (sa, ka, ma), (sb, kb, mb) in zip(a, reversed(b)))
        heapq.heappush(heap, (-(merged[-1][0] - merged[0][0]), next(counter), merged))
    return [sorted(members) for _, _, members in heap[0][2]]


def assign_to_ranks(parts: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    """Give part p to a rank so that as many samples as possible stay where they are: greedy on
    the overlap (samples of the part already on the rank; global position `rank * batch_size + i`),
    largest first, ties by part then rank. Returns the positions each rank trains, sorted."""
    world = len(parts)
    overlap = [[0] * world for _ in parts]
    for p, members in enumerate(parts):
        for position in members:
            overlap[p][position // batch_size] += 1
    pairs = sorted((-overlap[p][r], p, r) for p in range(world) for r in range(world))
    rank_of: dict[int, int] = {}
    taken: set[int] = set()
    for _, p, r in pairs:
        if p not in rank_of and r not in taken:
            rank_of[p] = r
            taken.add(r)
    positions: list[list[int]] = [[] for _ in range(world)]
    for p, r in rank_of.items():
        positions[r] = sorted(parts[p])
    return positions


@dataclass(frozen=True)
class ShufflePlan:
    """Which samples each rank trains (global positions `rank * batch_size + i`), and the balance
    it achieves: max over ranks of the rank's cost sum divided by the mean, before and after."""

    positions: list[list[int]]
    imbalance_before: float
    imbalance_after: float


def _imbalance(sums: Sequence[float]) -> float:
    mean = sum(sums) / len(sums)
    return max(sums) / mean if mean > 0 else 1.0


def solve_shuffle(costs: Sequence[float], world_size: int) -> ShufflePlan:
    """The plan for the gathered per-sample `costs` of `world_size` equal batches (rank-major).
    Never worse than the batches as loaded: when the partition does not lower the heaviest rank's
    cost (e.g. every sample costs the same), every rank keeps its own batch."""
    batch_size = len(costs) // world_size
    loaded = [list(range(r * batch_size, (r + 1) * batch_size)) for r in range(world_size)]
    positions = assign_to_ranks(karmarkar_karp(costs, world_size), batch_size)
    before = [sum(costs[i] for i in part) for part in loaded]
    after = [sum(costs[i] for i in part) for part in positions]
    if max(after) >= max(before):
        positions, after = loaded, before
    return ShufflePlan(positions, _imbalance(before), _imbalance(after))


class BalanceStats:
    """Running summary of the plans applied (thread-safe; read it after training)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches = 0
        self.sum_before = 0.0
        self.sum_after = 0.0

    def record(self, plan: ShufflePlan) -> None:
        with self._lock:
            self.batches += 1
            self.sum_before += plan.imbalance_before
            self.sum_after += plan.imbalance_after

    def summary(self) -> dict[str, float]:
        """Mean over batches of max/mean per-rank cost, before and after balancing."""
        with self._lock:
            n = max(self.batches, 1)
            return {
                "batches": self.batches,
                "imbalance_before": self.sum_before / n,
                "imbalance_after": self.sum_after / n,
            }


class BatchBalancer:
    """The two halves of the shuffle; one background thread solves the partitions.

    Args:
        sample_costs: batch -> `[B]` per-sample cost (the model's workload model).
        solver: (gathered costs, world size) -> `ShufflePlan`; `solve_shuffle` by default.
        group: the process group to balance over (default: the whole world).
    """

    def __init__(
        self,
        sample_costs: Callable[[Any], torch.Tensor],
        solver: Callable[[Sequence[float], int], ShufflePlan] = solve_shuffle,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self._sample_costs = sample_costs
        self._solver = solver
        self._group = group
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recsys-shuffle-solver")
        self.stats = BalanceStats()

    def _world(self) -> tuple[int, int]:
        if not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self._group), dist.get_world_size(self._group)

    def start(self, batch: Any) -> Future[ShufflePlan]:
        """All-gather this batch's per-sample costs and start solving its partition."""
        costs = self._sample_costs(batch).to(torch.float64).reshape(-1)
        _, world = self._world()
        if world > 1:
            gathered = [torch.empty_like(costs) for _ in range(world)]
            dist.all_gather(gathered, costs, group=self._group)
            costs = torch.cat(gathered)
        return self._pool.submit(self._solver, costs.tolist(), world)

    def finish(self, batch: Any, plan: Future[ShufflePlan]) -> Any:
        """Wait for `plan` (started by `start` on this same batch) and return this rank's share
        of all ranks' samples."""
        solved = plan.result()
        self.stats.record(solved)
        rank, world = self._world()
        mine = solved.positions[rank]
        batch_size = len(mine)
        if all(part == list(range(r * batch_size, (r + 1) * batch_size)) for r, part in enumerate(solved.positions)):
            return batch  # every rank keeps its batch (every rank sees the same plan): nothing to exchange
        if world == 1:
            return batch.select(torch.tensor(mine))
        device = batch.sample_ids.device
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, batch.to("cpu"), group=self._group)
        return type(batch).concat(everyone).select(torch.tensor(mine)).to(device, non_blocking=True)

    def close(self) -> None:
        """Stop the background solver thread after the partitions it is solving."""
        self._pool.shutdown(wait=True)
