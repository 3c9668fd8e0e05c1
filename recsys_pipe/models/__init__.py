"""Recommendation models and their torchrec sharding helpers."""

from recsys_pipe.models.hstu import HSTUConfig, HSTULayer, HSTUModel, HSTURanker, RelativeBias, embedding_tables
from recsys_pipe.models.sharding import SHARDING_TYPES, make_optimizer, make_sharded_model, sharding_plan

__all__ = [
    "SHARDING_TYPES",
    "HSTUConfig",
    "HSTULayer",
    "HSTUModel",
    "HSTURanker",
    "RelativeBias",
    "embedding_tables",
    "make_optimizer",
    "make_sharded_model",
    "sharding_plan",
]
