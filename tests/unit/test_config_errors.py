"""Every bad value in the model/data/optimizer/trainer sections is refused by both CLIs with exit
code 2 and one line naming its config path, before anything is started."""

from __future__ import annotations

import pytest

from recsys_pipe.cli import plan as plan_cli
from recsys_pipe.cli import train as train_cli

# (overrides, config path the error must name, fragment of the message)
CASES = [
    (["model.embedding_dim=33"], "model.num_heads", "embedding_dim (33) is not divisible by num_heads (2)"),
    (["model.embedding_dim=abc"], "model.embedding_dim", "valid integer"),
    (["model.num_layers=0"], "model.num_layers", "greater than or equal to 1"),
    (["model.dropout=1.5"], "model.dropout", "less than 1"),
    (["model.sharding=diagonal"], "model.sharding", "'table_column_wise', 'table_row_wise' or 'planner'"),
    (["model.name=hstux"], "model.name", "unknown model 'hstux' (did you mean 'hstu'?)"),
    (["+model.heads=4"], "model.heads", "unknown key 'heads'"),
    (["data.batch_size=0"], "data.batch_size", "greater than or equal to 1"),
    (["data.num_candidates=40"], "data.num_candidates", "must be < max_seq_len (32)"),
    (["data.max_seq_len=64", "data.num_candidates=4"], "data.max_seq_len", "exceeds model.max_seq_len (32)"),
    (["data.num_workers=-1"], "data.num_workers", "greater than or equal to 0"),
    (["data.name=nope"], "data.name", "unknown data source 'nope'; known: synthetic, movielens, criteo"),
    (["data.synthetic.num_tasks=0"], "data.synthetic.num_tasks", "greater than or equal to 1"),
    (["data.synthetic.chain_prob=2"], "data.synthetic.chain_prob", "less than or equal to 1"),
    (["data.synthetic.num_clusters=5000"], "data.synthetic.num_clusters", "must be <= num_items (1000)"),
    (["data=movielens"], "data.path", "missing required value"),
    (["data=movielens", "data.path=/nonexistent/ratings.dat"], "data.path", "no such file: /nonexistent/ratings.dat"),
    (["optimizer.lr=0"], "optimizer.lr", "greater than 0"),
    (["optimizer.name=lamb"], "optimizer.name", "unknown optimizer 'lamb'; known: sgd, adam, adamw, adagrad"),
    (["optimizer.sparse.name=ftrl"], "optimizer.sparse.name", "'rowwise_adagrad'"),
    (["optimizer.betas=[0.9]"], "optimizer.betas[1]", "missing list item"),
    (["trainer.log_every=0"], "trainer.log_every", "greater than or equal to 1"),
    (["trainer.device=tpu"], "trainer.device", "'auto', 'cpu' or 'cuda'"),
    (["trainer.eval_batches=-1"], "trainer.eval_batches", "greater than or equal to 0"),
    (["seed=abc"], "seed", "valid integer"),
    (["pipeline=hstu_prefetch", "pipeline.torchrec_context=base"], "pipeline.torchrec_context", "prefetch context"),
]


@pytest.mark.parametrize("overrides, path, fragment", CASES, ids=[" ".join(c[0]) for c in CASES])
@pytest.mark.parametrize("cli", ["recsys-plan", "recsys-train"])
def test_bad_value_exits_2_naming_its_path(cli, overrides, path, fragment, tmp_path, capsys, no_process_group):
    run = plan_cli.run if cli == "recsys-plan" else train_cli.run
    code = run([*overrides, f"hydra.run.dir={tmp_path}", f"trainer.output_dir={tmp_path}/runs"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert lines and lines[0].startswith(f"error: {path}: "), err
    assert fragment in err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()
