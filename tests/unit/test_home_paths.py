"""`~` in every path key (as a shell expands it), from the command line and from YAML; a run
directory that does not exist is named as such by recsys-eval and recsys-export."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys_pipe.testing import load_run, train_here


def test_home_in_path_keys_is_expanded(tmp_path, monkeypatch, capsys, no_process_group):
    monkeypatch.setenv("HOME", str(tmp_path))
    rng = np.random.default_rng(0)
    cols = {"label": rng.integers(0, 2, 64)} | {f"int_{i}": rng.integers(0, 9, 64) for i in range(13)}
    cols |= {f"cat_{i}": rng.integers(0, 9, 64) for i in range(26)}
    pq.write_table(pa.table(cols), tmp_path / "c.parquet")
    args = ["model=dlrm", "data=parquet", "data.path=~/c.parquet", "data.batch_size=4", "trainer.output_dir=~/runs"]
    args += ["trainer.resume_from=~/nothing"]
    assert train_here("--check", *args) == 2  # the checkpoint path, expanded: named as the file it looked for
    assert f"no such checkpoint or run directory: {tmp_path}/nothing" in capsys.readouterr().err
    assert train_here("--check", *args[:-1]) == 0, capsys.readouterr().err
    run = load_run(*args[:2], f"data.path={tmp_path}/c.parquet", "trainer.output_dir='~/runs'", "data.eval_path='~/c'")
    assert run.trainer.output_dir == f"{tmp_path}/runs" and run.data.eval_path == f"{tmp_path}/c"


def test_a_misspelt_run_dir_is_no_such_directory(tmp_path, capsys):
    from recsys_pipe.cli import eval as eval_cli
    from recsys_pipe.cli import export as export_cli

    missing = tmp_path / "runs" / "recsys-trian"
    assert eval_cli.run([str(missing)]) == 2
    assert capsys.readouterr().err.splitlines()[0] == f"error: run_dir: {missing}: no such directory"
    assert export_cli.run([str(missing), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines()[0] == f"error: run_dir: {missing}: no such directory"
    assert not (tmp_path / "out").exists()  # nothing written
