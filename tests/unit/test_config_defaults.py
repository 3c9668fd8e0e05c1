"""One source per default: every default and description is a pydantic `Field`; the YAML option
files hold only what differs from it, and list their component's generated defaults first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import open_dict

from recsys_pipe.cli import compose_config
from recsys_pipe.config import CONF_DIR
from recsys_pipe.config.structured import defaults_node
from recsys_pipe.train.config import RunConfig, TrainerConfig

SECTIONS = ("model", "data", "optimizer")


def _class_defaults(section: str, option: dict[str, Any]) -> dict[str, Any]:
    if section == "trainer":
        return defaults_node(TrainerConfig)
    registry = RunConfig.COMPONENTS[section]
    name = option.get("name")
    return defaults_node(registry.config_class({"name": name}, section) if name else registry.base)


def restated(option: dict[str, Any], defaults: dict[str, Any], prefix: str = "") -> list[str]:
    """Keys of `option` whose value equals the default (restated) or that the class lacks."""
    found = []
    for key, value in option.items():
        if key in ("defaults", "name"):
            continue
        path = f"{prefix}{key}"
        if key not in defaults:
            found.append(f"{path}: not a field of the config class")
        elif isinstance(value, dict) and isinstance(defaults[key], dict):
            found += restated(value, defaults[key], f"{path}.")
        elif value == defaults[key] or (isinstance(defaults[key], tuple) and list(defaults[key]) == value):
            found.append(f"{path}: restates the default {value!r}")
    return found


def _options(section: str) -> list[Path]:
    return sorted((CONF_DIR / section).glob("*.yaml"))


@pytest.mark.parametrize("section", ["trainer", *SECTIONS])
def test_option_files_hold_only_overrides(section):
    for path in _options(section):
        option = yaml.safe_load(path.read_text()) or {}
        assert restated(option, _class_defaults(section, option)) == [], path.name


def test_default_options_hold_nothing():
    """`trainer/default.yaml` is the class defaults: a value there would contradict the Field."""
    option = yaml.safe_load((CONF_DIR / "trainer" / "default.yaml").read_text())
    assert option is None


@pytest.mark.parametrize("section", SECTIONS)
def test_option_files_start_from_their_generated_defaults(section):
    for path in _options(section):
        option = yaml.safe_load(path.read_text())
        schema = option.get("name") or "builder"
        assert option["defaults"][0] == f"/hydra/recsys_defaults/{section}/{schema}@_here_", path.name


def test_composed_defaults_are_the_field_defaults():
    cfg = compose_config()
    with open_dict(cfg):
        del cfg["hydra"]
    assert dict(cfg.trainer) | {"checkpoint": dict(cfg.trainer.checkpoint)} | {
        "torch_profiler": dict(cfg.trainer.torch_profiler)
    } == defaults_node(TrainerConfig)
    assert (cfg.seed, cfg.debug) == (RunConfig.model_fields["seed"].default, RunConfig.model_fields["debug"].default)
    assert cfg.optimizer.lr == RunConfig.COMPONENTS["optimizer"].config_class({"name": "adam"}, "o")().lr


def test_every_key_of_a_component_is_overridable_by_path():
    """Keys no YAML spells out still take `path=value` (no `+`): the generated defaults hold them."""
    cfg = compose_config("model=dlrm", "model.embedding_dim=8", "data.synthetic.signal=2.0", "optimizer.eps=0.1")
    assert (cfg.model.embedding_dim, cfg.data.synthetic.signal, cfg.optimizer.eps) == (8, 2.0, 0.1)


def test_restated_and_unknown_values_are_found():
    defaults = _class_defaults("trainer", {})
    assert restated({"max_steps": defaults["max_steps"], "checkpoint": {"interval": 0}, "max_step": 3}, defaults) == [
        f"max_steps: restates the default {defaults['max_steps']!r}",
        "checkpoint.interval: restates the default 0",
        "max_step: not a field of the config class",
    ]
