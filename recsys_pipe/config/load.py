"""Turn the Hydra-composed config into validated pydantic sections.

Shared by `recsys-plan` and `recsys-train` (through `recsys_pipe.train.config.load_run_config`),
so both refuse exactly the same configs with exactly the same messages.
"""

from __future__ import annotations

from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from recsys_pipe.config.errors import ConfigError, ConfigProblem, problems_from_validation_error

__all__ = ["to_container", "validate_section"]

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


def validate_section(model: type[M], data: Any, prefix: str = "") -> M:
    """Validate one section of the run config, with every error as a config-path problem.

    Args:
        model: the section's pydantic class.
        data: the section's values (a mapping, or an OmegaConf node).
        prefix: the section's place in the run config (e.g. `data`), which every problem's path
            starts with.

    Returns:
        `model.model_validate(data)`. Raises ConfigError with one problem per validation error."""
    data = to_container(data, prefix)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(problems_from_validation_error(exc, model, prefix.split(".") if prefix else ())) from None


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix and key else (prefix or key)
