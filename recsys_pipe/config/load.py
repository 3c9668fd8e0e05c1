"""Turn the Hydra-composed config into validated pydantic models.

Shared by `recsys-plan` and `recsys-train`: both call `load_run_config(cfg)` first, so both
refuse exactly the same configs with exactly the same messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from recsys_pipe.config.errors import ConfigError, ConfigProblem, problems_from_validation_error
from recsys_pipe.config.schema import RunConfig

__all__ = ["to_container", "load_run_config"]

M = TypeVar("M", bound=BaseModel)


def to_container(cfg: Any, prefix: str = "") -> Any:
    """`OmegaConf.to_container(resolve=True)`, with missing values (`???`) and broken
    interpolations reported as ConfigError at their config path."""
    if not isinstance(cfg, (DictConfig, ListConfig)):
        return cfg
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as exc:
        raise ConfigError(ConfigProblem(_join(prefix, exc.full_key), "missing required value (???)")) from None
    except OmegaConfBaseException as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(ConfigProblem(_join(prefix, getattr(exc, "full_key", "") or ""), message)) from None


def load_run_config(cfg: Any, model: type[M] = RunConfig) -> M:  # type: ignore[assignment]
    """Validate the whole composed config (DictConfig or mapping) into `model` (RunConfig).

    Raises ConfigError with one problem per field error. This checks shapes and values only;
    `compile_plan(run.pipeline)` checks the plan as a schedule.
    """
    data = to_container(cfg)
    if isinstance(data, Mapping):
        data = {k: v for k, v in data.items() if k != "hydra"}
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(problems_from_validation_error(exc, model)) from None


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix and key else (prefix or key)
