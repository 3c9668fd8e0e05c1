"""Retrieval batches edited for loss tests (shared by test modules)."""

from __future__ import annotations

import dataclasses

import numpy as np

from recsys_pipe.data.sequences import NEG_KEY, POS_KEY, RetrievalBatch


def with_collisions(batch: RetrievalBatch, per_target: int) -> RetrievalBatch:
    """`batch` with some negatives equal to their position's target, which the loss masks out:
    the first negative of every other position (`per_target` negatives each, target by target)."""
    kjt = batch.sparse_features
    values = kjt.values().clone()
    per_key = kjt.length_per_key()
    start = dict(zip(kjt.keys(), np.cumsum([0, *per_key[:-1]]).tolist()))
    pos = values[start[POS_KEY] : start[POS_KEY] + per_key[kjt.keys().index(POS_KEY)]]
    neg = values[start[NEG_KEY] :]
    neg[: len(pos) * per_target : 2 * per_target] = pos[::2]
    collided = type(kjt)(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    return dataclasses.replace(batch, sparse_features=collided)
