"""`parallel.pp`: every constraint exits 2 with one line naming its key, before any process
group starts; the layer split."""

from __future__ import annotations

import pytest

from recsys_pipe.cli import train as train_cli
from recsys_pipe.pp import split_layers

# (WORLD_SIZE, overrides, the key the first error names, a fragment of its message)
CASES = [
    (2, ["parallel.pp.size=2", "parallel.pp.microbatches=1"], "parallel.pp.microbatches", "cannot fill 2 stages"),
    (1, ["parallel.pp.size=2"], "parallel.pp.size", "2 stages do not divide the world of 1 rank(s)"),
    (2, ["parallel.pp.schedule=dualpipe"], "parallel.pp.schedule", "'gpipe', '1f1b', 'zb_h1' or 'zb_h2'"),
    (2, ["parallel.pp.size=2", "parallel.pp.layers=[1,1,1]"], "parallel.pp.layers", "lists 3 stage(s)"),
    (2, ["parallel.pp.size=2", "parallel.pp.layers=[1,2]"], "parallel.pp.layers", "model.num_layers=2"),
    (4, ["parallel.pp.size=4"], "parallel.pp.size", "4 stages need at least 4 layers, model.num_layers=2"),
    (2, ["parallel.pp.size=2", "model=dlrm"], "parallel.pp.size", "model 'dlrm' cannot be split into stages"),
    (2, ["parallel.pp.size=2", "parallel.pp.microbatches=3"], "parallel.pp.microbatches", "data.batch_size=32"),
    (2, ["parallel.pp.size=2", "parallel.pp.schedule=zb_h1"], "parallel.pp.size", "does not run pipeline-parallel"),
]


@pytest.fixture
def no_process_group(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process group was started for a config that should have been refused")

    import recsys_pipe.runtime.session

    for module in (recsys_pipe.runtime, recsys_pipe.runtime.session):
        monkeypatch.setattr(module, "init_distributed", refuse)


@pytest.mark.parametrize(("world", "overrides", "path", "fragment"), CASES, ids=[" ".join(c[1]) for c in CASES])
def test_pp_constraint_exits_2_naming_its_key(
    world, overrides, path, fragment, tmp_path, capsys, monkeypatch, no_process_group
):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    code = train_cli.run([*overrides, f"hydra.run.dir={tmp_path}", f"trainer.output_dir={tmp_path}/runs"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert lines and lines[0].startswith(f"error: {path}: "), err
    assert fragment in err
    assert "Traceback" not in err


def test_no_pipeline_passes_every_check(tmp_path, monkeypatch, no_process_group):
    """parallel.pp.size=1 (the default) with one microbatch: `--check` exits 0."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    code = train_cli.run(
        ["--check", "parallel.pp.microbatches=1", f"hydra.run.dir={tmp_path}", f"trainer.output_dir={tmp_path}/runs"]
    )
    assert code == 0


def test_layers_split_evenly_first_stages_larger_or_as_listed():
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert split_layers(4, 3, [1, 2, 1]) == [range(0, 1), range(1, 3), range(3, 4)]
    with pytest.raises(ValueError, match="cannot split 4 layers into 2 stages"):
        split_layers(4, 2, [1, 2])
