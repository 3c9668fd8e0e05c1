"""The config a CLI would see, composed without running anything (for tests and tools)."""

from __future__ import annotations

from omegaconf import DictConfig

from recsys_pipe.cli.hydra_adapter import compose_with_hydra_node
from recsys_pipe.cli.schemas import register_schemas
from recsys_pipe.config import CONF_DIR

__all__ = ["compose_config"]


def compose_config(*overrides: str, config_name: str = "config") -> DictConfig:
    """The config Hydra composes for `config_name` with these command-line overrides, with its
    `hydra` node (as `recsys-train`/`recsys-plan` would see it, without running anything)."""
    register_schemas()
    return compose_with_hydra_node(CONF_DIR, config_name, list(overrides))
