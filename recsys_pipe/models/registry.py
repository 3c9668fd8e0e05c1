"""Models by name (`model.name=...`): each entry is the import path of the model's config class."""

from recsys_pipe.config import Registry

__all__ = ["MODELS"]

MODELS = Registry("model", {"hstu": "recsys_pipe.models.hstu:HSTUConfig"})
