"""Retrieval batches edited for loss tests (shared by test modules)."""

from __future__ import annotations

from recsys_pipe.data.batch import POS_KEY, RetrievalBatch


def with_collisions(batch: RetrievalBatch, per_target: int) -> RetrievalBatch:
    """`batch` with some negatives equal to their position's target, which the loss masks out:
    the first negative of every other position (`per_target` negatives each, target by target)."""
    pos = batch.sparse_features[POS_KEY].values()
    neg = batch.negatives_per_position().clone()
    neg[: len(pos) * per_target : 2 * per_target] = pos[::2]
    return batch.with_negatives(neg)
