"""What a data source tells the model: vocabulary sizes and label layout."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataSpec:
    """Sizes a model needs to match a data source (ids are in `[0, num_*)`).

    `num_actions` includes the masked action id 0 used for candidate tokens;
    `num_users` sizes the contextual `user` table; 0 when the batches carry no user feature.
    """

    num_items: int
    num_actions: int
    num_tasks: int
    num_users: int
