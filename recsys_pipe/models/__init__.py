"""Recommendation models, their configs and torchrec sharding helpers.

A model is picked by `model.name` from `MODELS`; its config class (a `ModelConfig`) validates
the `model.*` keys and builds it for a data source (`cfg.build(spec)`).
"""

from recsys_pipe.models.base import ModelConfig
from recsys_pipe.models.hstu import HSTUConfig, HSTULayer, HSTUModel, HSTURanker, RelativeBias, embedding_tables
from recsys_pipe.models.registry import MODELS
from recsys_pipe.models.sharding import SHARDING_TYPES, make_optimizer, make_sharded_model, sharding_plan

__all__ = [
    "MODELS",
    "SHARDING_TYPES",
    "HSTUConfig",
    "HSTULayer",
    "HSTUModel",
    "HSTURanker",
    "ModelConfig",
    "RelativeBias",
    "embedding_tables",
    "make_optimizer",
    "make_sharded_model",
    "sharding_plan",
]
