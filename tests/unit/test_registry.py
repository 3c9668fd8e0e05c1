"""Registries: models, data sources and optimizers by name or by builder import path; the config
class of a builder comes from its annotation; a user's own model and data source train."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsys_pipe.config import ConfigError, builder_config_class
from recsys_pipe.data import DATA_SOURCES, DataConfig, SyntheticDataConfig
from recsys_pipe.models import MODELS, DLRMConfig, HSTUConfig, ModelConfig, TorchDLRMConfig
from recsys_pipe.train import OPTIMIZERS, OptimizerConfig, load_run_config
from recsys_pipe.train.optim import AdamWConfig, SGDConfig

HERE = Path(__file__).resolve().parents[1]  # tests/: custom_components.py
BIN = Path(sys.executable).parent


def base(**sections) -> dict:
    return {
        "pipeline": {"tasks": {"a": {"fn": "m:f"}}},
        "model": {"name": "hstu"},
        "data": {"name": "synthetic"},
        **sections,
    }


def problems(data: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_run_config(data)
    return {p.path: p.message for p in info.value.problems}


def test_names_pick_config_classes_and_their_builders():
    assert MODELS.config_class({"name": "dlrm"}, "model") is DLRMConfig
    assert MODELS.config_class({"name": "dlrm_torch"}, "model") is TorchDLRMConfig
    assert DATA_SOURCES.config_class({"name": "synthetic"}, "data") is SyntheticDataConfig
    assert OPTIMIZERS.config_class({"name": "adamw"}, "optimizer") is AdamWConfig
    run = load_run_config(base(optimizer={"name": "sgd", "momentum": 0.5}))
    assert isinstance(run.optimizer, SGDConfig) and run.optimizer.builder == "recsys_pipe.train.optim:build_sgd"
    assert run.model.builder == "recsys_pipe.models.hstu:build_hstu"
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(run.optimizer.build(params), torch.optim.SGD)


@pytest.mark.parametrize(
    "section, value, message",
    [
        (
            "model",
            {"name": "dlrn"},
            "unknown model 'dlrn' (did you mean 'dlrm'?); "
            "known: hstu, dlrm, dlrm_dcn, dlrm_torch, sasrec, hstu_retrieval",
        ),
        ("data", {"name": "criteo_synth"}, "unknown data source 'criteo_synth'"),
        ("optimizer", {"name": "lamb"}, "unknown optimizer 'lamb'; known: sgd, adam, adamw, adagrad"),
    ],
)
def test_unknown_names_list_the_known_ones(section, value, message):
    assert message in problems(base(**{section: value}))[f"{section}.name"]


def test_name_and_builder_together_are_refused():
    found = problems(base(model={"name": "hstu", "builder": "custom_components:build_model"}))
    assert "set either model.name (a registered model) or model.builder" in found["model.builder"]


@pytest.mark.parametrize(
    "builder, fragment",
    [
        ("no_such_module_xyz:build", "No module named 'no_such_module_xyz'"),
        ("custom_components:nope", "has no attribute 'nope'"),
        (
            "custom_components:build_data",
            "annotated <class 'custom_components.ClicksConfig'>, which is not ModelConfig",
        ),
    ],
)
def test_bad_builders_are_config_errors(builder, fragment):
    assert fragment in problems(base(model={"builder": builder}))["model.builder"]


def test_an_optimizer_by_builder_path():
    run = load_run_config(base(optimizer={"builder": "recsys_pipe.train.optim:build_sgd", "momentum": 0.25}))
    assert isinstance(run.optimizer, SGDConfig) and run.optimizer.momentum == 0.25 and run.optimizer.name == "sgd"
    optimizer = run.optimizer.build([torch.nn.Parameter(torch.zeros(1))])
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.25


def test_a_class_can_be_the_builder():
    run = load_run_config(base(model={"builder": "custom_components:Pooled", "hidden": 3}))
    assert type(run.model).__name__ == "PooledConfig" and run.model.hidden == 3


def test_builder_annotation_is_the_config_class():
    def annotated(cfg: HSTUConfig, spec): ...

    def plain(cfg, spec): ...

    def wrong(cfg: int, spec): ...

    assert builder_config_class(annotated, ModelConfig) is HSTUConfig
    assert builder_config_class(plain, ModelConfig) is ModelConfig
    with pytest.raises(TypeError, match="is not ModelConfig or a subclass"):
        builder_config_class(wrong, ModelConfig)
    with pytest.raises(TypeError, match="is not DataConfig or a subclass"):
        builder_config_class(annotated, DataConfig)
    assert builder_config_class(lambda cfg, params: None, OptimizerConfig) is OptimizerConfig


def test_user_builder_keys_are_validated_by_its_config_class():
    run = load_run_config(
        base(
            model={"builder": "custom_components:build_model", "hidden": 4},
            data={"builder": "custom_components:build_data", "num_users": 7},
        )
    )
    assert type(run.model).__name__ == "PooledConfig" and run.model.hidden == 4 and run.model.name is None
    assert run.model.label == "custom_components:build_model"
    assert type(run.data).__name__ == "ClicksConfig" and run.data.dataset(0, 1).spec.vocab_sizes["user"] == 7
    found = problems(base(model={"builder": "custom_components:build_model", "hiden": 4}))
    assert "unknown key 'hiden' (did you mean 'hidden'?)" in found["model.hiden"]
    found = problems(base(model={"builder": "custom_components:build_model", "hidden": "wide"}))
    assert "valid integer" in found["model.hidden"]


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [str(BIN / "recsys-train"), *overrides, "trainer=smoke", f"trainer.output_dir={tmp_path}/runs"],
        capture_output=True,
        text=True,
        timeout=250,
        cwd=tmp_path,
        env=env,
    )


@pytest.mark.timeout(300)
def test_a_user_model_and_data_source_train_by_import_path(tmp_path):
    """The README's custom example: the user's builders, their own keys, a plan with lookaheads."""
    proc = _train(
        tmp_path,
        "model=custom",
        "model.builder=custom_components:build_model",
        "+model.hidden=8",
        "data=custom",
        "data.builder=custom_components:build_data",
        "data.batch_size=64",
        "optimizer.sparse.lr=0.1",
        "pipeline=hstu_prefetch",
        "trainer.max_steps=60",
        "trainer.eval_every=60",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = (tmp_path / "runs").glob("recsys-train/*/metrics.jsonl")
    evals = [r for r in map(json.loads, metrics.read_text().splitlines()) if "auc" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 60
    assert evals[-1]["auc"] > evals[0]["auc"] + 0.2  # it learned the parity rule
    bad = _train(tmp_path, "model=custom", "model.builder=custom_components:build_model", "+model.hidden=wide")
    assert bad.returncode == 2 and "error: model.hidden:" in bad.stderr and "Traceback" not in bad.stderr
