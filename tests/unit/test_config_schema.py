"""The pydantic sections and their error messages: paths, suggestions, registries, layering."""

from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from recsys_pipe.config import TASK_FIELDS, ConfigError, PlanConfig, TaskConfig, plan_skeleton
from recsys_pipe.config.errors import problems_from_validation_error, suggest
from recsys_pipe.data import DataConfig, SyntheticDataConfig
from recsys_pipe.models import HSTUConfig, ModelConfig
from recsys_pipe.train import RunConfig, load_run_config


def problems(data: dict, model=RunConfig) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_run_config(data, model)
    return {p.path: p.message for p in info.value.problems}


def base(**pipeline) -> dict:
    return {
        "pipeline": {"tasks": {"a": {"fn": "m:f"}}, **pipeline},
        "model": {"name": "hstu"},
        "data": {"name": "synthetic"},
    }


def test_minimal_config_validates_with_defaults():
    run = load_run_config(base())
    assert isinstance(run.model, HSTUConfig) and isinstance(run.data, SyntheticDataConfig)  # picked by name
    task = run.pipeline.tasks["a"]
    assert (task.stream, task.lookahead, task.nccl, task.reads) == ("default", 0, False, [])
    assert run.pipeline.executor == "sequential" and run.pipeline.thread_map.strategy == "by_stream"


def test_slots_accept_name_or_pair():
    plan = PlanConfig.model_validate(
        {"tasks": {"a": {"fn": "m:f", "reads": ["x", ["y", 2]], "cross_iter_depends_on": ["b", ["c", -2]]}}}
    )
    assert plan.tasks["a"].reads == ["x", ("y", 2)]
    assert plan.tasks["a"].cross_iter_depends_on == ["b", ("c", -2)]


def test_unknown_key_suggests_and_lists_valid_keys():
    data = base()
    data["pipeline"]["tasks"]["a"]["dependson"] = ["b"]
    msg = problems(data)["pipeline.tasks.a.dependson"]
    assert "unknown key 'dependson'" in msg and "did you mean 'depends_on'" in msg
    assert "valid keys: fn, stream, lookahead" in msg


def test_unknown_top_level_and_nested_keys():
    data = base()
    data["seeed"] = 1
    data["optimizer"] = {"name": "adam", "sparse": {"lrr": 0.1}}
    found = problems(data)
    assert "did you mean 'seed'" in found["seeed"]
    assert "did you mean 'lr'" in found["optimizer.sparse.lrr"]


def test_list_items_have_index_paths():
    data = base()
    data["pipeline"]["tasks"]["a"]["reads"] = ["ok", 3, ["x", "y"]]
    found = problems(data)
    assert set(found) == {"pipeline.tasks.a.reads[1]", "pipeline.tasks.a.reads[2]"}
    assert "[name, batch_offset]" in found["pipeline.tasks.a.reads[1]"]


def test_wrong_types_are_not_coerced():
    data = base()
    data["pipeline"]["tasks"]["a"].update(lookahead="1", nccl="yes")
    found = problems(data)
    assert set(found) == {"pipeline.tasks.a.lookahead", "pipeline.tasks.a.nccl"}
    assert "'1'" in found["pipeline.tasks.a.lookahead"]


def test_missing_required_keys():
    found = problems({"pipeline": {"tasks": {"a": {}}}})
    assert found["pipeline.tasks.a.fn"] == "missing required key"
    assert found["model"] == "missing required key"


def test_omegaconf_missing_value_has_path():
    cfg = OmegaConf.create(base())
    cfg.pipeline.tasks.a.fn = "???"
    assert problems(cfg) == {"pipeline.tasks.a.fn": "missing required value (???)"}


def test_skeleton_mirrors_task_fields():
    # A task merged into the skeleton gets every field with its default (overridable by path).
    merged = OmegaConf.merge(OmegaConf.structured(plan_skeleton()), {"tasks": {"t": {"fn": "m:f"}}})
    assert tuple(merged.tasks["t"].keys()) == TASK_FIELDS
    assert merged.tasks["t"].lookahead == TaskConfig.model_fields["lookahead"].default


def test_suggest():
    assert suggest("lookahed", TASK_FIELDS) == " (did you mean 'lookahead'?)"
    assert suggest("zzz", TASK_FIELDS) == ""


def test_problems_from_validation_error_prefix():
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        PlanConfig.model_validate({"tasks": {"a": {"fn": "m:f", "lookahead": -2}}})
    (p,) = problems_from_validation_error(info.value, PlanConfig, ("pipeline",))
    assert p.path == "pipeline.tasks.a.lookahead" and "greater than or equal to 0" in p.message


def test_config_layer_imports_no_hydra_or_matplotlib():
    """Layering: the plan compiler imports engine, pydantic and omegaconf only."""
    code = (
        "import sys, recsys_pipe.config\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'matplotlib', 'torchrec'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def _keys(node, prefix=""):
    out = set()
    for key, value in node.items():
        out.add(prefix + key)
        if isinstance(value, dict):
            out |= _keys(value, f"{prefix}{key}.")
    return out


def _fields(model, prefix=""):
    from pydantic import BaseModel

    out = set()
    for name, info in type(model).model_fields.items():
        out.add(prefix + (info.alias or name))  # YAML spells a field by its alias (checkpoint.async)
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out |= _fields(value, f"{prefix}{name}.")
    return out


def plain_model(cfg: ModelConfig, spec):
    """A builder whose config is the base class: stands in for `builder: ???` of model=custom."""
    raise AssertionError("never built")


def plain_data(cfg: DataConfig, rank, world_size):
    """Likewise for data=custom."""
    raise AssertionError("never built")


@pytest.mark.parametrize("group", ["model", "data", "optimizer", "trainer"])
def test_shipped_options_compose_every_key(group, tmp_path):
    """Every key of a section is in the composed config of each of its options, so it is
    overridable by path (no `+`), although the YAML holds only overrides (the rest comes from the
    config class's defaults, see tests/unit/test_config_defaults.py). The component selectors are the
    exception: a section has `name` (a registered component, whose config class fills in its
    builder) or `builder` (model=custom, data=custom), not both."""
    from recsys_pipe.cli import compose_config
    from recsys_pipe.config import CONF_DIR, validate_section
    from recsys_pipe.train import TrainerConfig

    options = sorted((CONF_DIR / group).glob("*.yaml"))
    assert options
    for path in options:
        raw = OmegaConf.to_container(compose_config(f"{group}={path.stem}")[group])
        if raw.get("path") == "???":
            raw["path"] = __file__  # movielens, criteo: any existing file passes validation
        if raw.get("builder") == "???":
            raw["builder"] = f"{__name__}:plain_{group}"
        if group == "trainer":
            validated, selectors = validate_section(TrainerConfig, raw, group), set()
        else:
            raw = {k: v for k, v in raw.items() if v is not None or k not in ("name", "builder")}
            cls = RunConfig.COMPONENTS[group].config_class(raw, group)
            validated, selectors = validate_section(cls, raw, group), {"name", "builder"}
        assert _keys(raw) | selectors == _fields(validated), path.name
        assert len(selectors & set(raw)) == (1 if selectors else 0), path.name
