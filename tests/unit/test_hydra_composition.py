"""Hydra's composition, made cheaper in `recsys_pipe.cli.hydra_adapter` (a shallow copy of the
config repository, each YAML file parsed once per content): it composes exactly what Hydra's own
code composes, sees a config file edited between two compositions, and still reports a broken
file in Hydra's words."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from recsys_pipe.cli.compose import compose_config

OVERRIDE_SETS = [
    [],
    ["pipeline=hstu_prefetch", "thread_map=per_task"],
    ["model=dlrm", "data=criteo_synthetic", "pipeline=sparse_dist"],
    ["model=sasrec", "trainer=smoke"],
    ["pipeline=semi_sync", "optimizer=sgd"],
]

#: composes OVERRIDE_SETS with Hydra's own code (the adapter's changes never applied) and prints them
UNCHANGED_HYDRA = """
import json, sys
import recsys_pipe.cli.hydra_adapter as adapter
adapter._patched = True  # as if applied: Hydra's methods stay as Hydra ships them
from omegaconf import OmegaConf
from recsys_pipe.cli.compose import compose_config
print(json.dumps([OmegaConf.to_yaml(compose_config(*o)) for o in json.loads(sys.argv[1])]))
"""


def _user_pipeline(tmp_path: Path, body: str) -> str:
    (tmp_path / "conf" / "pipeline").mkdir(parents=True, exist_ok=True)
    (tmp_path / "conf" / "pipeline" / "mine.yaml").write_text(body)
    return f"hydra.searchpath=[file://{tmp_path / 'conf'}]"


@pytest.mark.timeout(120)
def test_the_cheaper_composition_composes_what_hydra_composes():
    ours = [OmegaConf.to_yaml(compose_config(*o)) for o in OVERRIDE_SETS]
    ours_again = [OmegaConf.to_yaml(compose_config(*o)) for o in OVERRIDE_SETS]  # from the parsed files
    proc = subprocess.run(
        [sys.executable, "-c", UNCHANGED_HYDRA, json.dumps(OVERRIDE_SETS)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    hydras = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ours == ours_again == hydras
    assert len({*hydras}) == len(OVERRIDE_SETS)  # the sets compose different configs


def test_a_config_file_edited_between_compositions_is_read_again(tmp_path):
    searchpath = _user_pipeline(tmp_path, "defaults:\n  - serial\n  - _self_\nexecutor: sequential\n")
    assert compose_config(searchpath, "pipeline=mine").pipeline.executor == "sequential"
    _user_pipeline(tmp_path, "defaults:\n  - serial\n  - _self_\nexecutor: threaded  \n")  # same length
    assert compose_config(searchpath, "pipeline=mine").pipeline.executor == "threaded"


def test_a_broken_config_file_is_still_reported_by_hydra(tmp_path):
    """The YAML error names the file, line and column, as Hydra's own reading does."""
    import yaml

    searchpath = _user_pipeline(tmp_path, "defaults:\n  - serial\nexecutor: [unclosed\n")
    with pytest.raises(yaml.YAMLError) as info:
        compose_config(searchpath, "pipeline=mine")
    assert f'in "{tmp_path / "conf" / "pipeline" / "mine.yaml"}", line 3, column 11' in str(info.value)
