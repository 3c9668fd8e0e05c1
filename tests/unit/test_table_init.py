"""`model.table_init=per_shard`: the tables built on the meta device, each rank drawing only its
own shards (`recsys_pipe.models.sharding.init_table_slice`). Any slice of a table is the same
rows of the whole table, drawn by the table's own init function; a model built this way holds
those tables and a seeded dense part; the combinations it cannot serve exit 2 in one line. The
2-rank run that trains and resumes bitwise: tests/integration/test_resume.py."""

from __future__ import annotations

import math

import pytest
import torch
from _process_group import one_rank_group
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from recsys_pipe.cli import train as train_cli
from recsys_pipe.models.sharding import INIT_BLOCK_ROWS, init_table_slice
from recsys_pipe.testing import built_trainer
from recsys_pipe.train import local_parameters

ROWS = 2 * INIT_BLOCK_ROWS + 100  # three blocks, the last one short
DIM = 8


def _table(rows: int = ROWS, **kwargs) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=rows, feature_names=["f"], **kwargs)


def test_any_slice_of_a_table_is_those_rows_and_columns_of_the_whole_table():
    cfg = _table()
    before = torch.get_rng_state()
    whole = init_table_slice(cfg, 0, (0, ROWS), (0, DIM))
    assert torch.equal(torch.get_rng_state(), before)  # the global generator is left as it was
    cuts = [0, 1000, INIT_BLOCK_ROWS + 7, ROWS]  # row shards across the blocks' boundaries
    assert torch.equal(torch.cat([init_table_slice(cfg, 0, (a, b), (0, DIM)) for a, b in zip(cuts, cuts[1:])]), whole)
    columns = [init_table_slice(cfg, 0, (0, ROWS), (c, c + 4)) for c in (0, 4)]
    assert torch.equal(torch.cat(columns, dim=1), whole)
    assert torch.equal(init_table_slice(cfg, 0, (5000, 5010), (4, 8)), whole[5000:5010, 4:8])
    assert torch.equal(init_table_slice(cfg, 0, (0, ROWS), (0, DIM)), whole)  # the same seed: bitwise the same
    assert not torch.equal(init_table_slice(cfg, 1, (0, ROWS), (0, DIM)), whole)
    other = EmbeddingBagConfig(name="u", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["f"])
    assert not torch.equal(init_table_slice(other, 0, (0, ROWS), (0, DIM)), whole)  # tables draw apart


def test_the_values_follow_the_tables_init_fn_as_the_unsharded_build_draws_it():
    """torchrec's default (uniform within +-sqrt(1/rows)) and a model's own init function (the
    retrieval models' normal), compared with the unsharded table torchrec builds."""
    bound = math.sqrt(1 / ROWS)
    whole = init_table_slice(_table(), 0, (0, ROWS), (0, DIM))
    torch.manual_seed(0)
    unsharded = EmbeddingBagCollection(tables=[_table()]).embedding_bags["t"].weight.detach()
    for values in (whole, unsharded):
        assert values.abs().max() <= bound and values.unique().numel() > 0.99 * values.numel()
        assert abs(float(values.mean())) < 0.02 * bound
        assert abs(float(values.std()) - bound / math.sqrt(3)) < 0.02 * bound  # a uniform's
    blocks = whole[:INIT_BLOCK_ROWS], whole[INIT_BLOCK_ROWS : 2 * INIT_BLOCK_ROWS]
    assert not torch.equal(*blocks)  # each block its own draw
    normal = _table(init_fn=lambda w: torch.nn.init.normal_(w, 0.0, 0.02))
    assert abs(float(init_table_slice(normal, 0, (0, ROWS), (0, DIM)).std()) - 0.02) < 0.001


RUN = [
    "model=dlrm",
    "data.num_embeddings=3000",
    "pipeline=serial",
    "trainer=smoke",
    "trainer.max_steps=3",
    "trainer.tensorboard=false",
    "model.table_init=per_shard",
]


@pytest.fixture(scope="module")
def info():
    with one_rank_group() as info:
        yield info


def test_a_per_shard_model_holds_the_drawn_tables_and_a_seeded_dense_part(info):
    with built_trainer(info, RUN) as trainer:
        first = local_parameters(trainer.state.model)
        dim = trainer.run.model.embedding_dim
        summary = trainer.fit(record_steps=True)
    with built_trainer(info, RUN) as trainer:
        second = local_parameters(trainer.state.model)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)  # the same seed: bitwise the same model
    tables = {k: v for k, v in first.items() if "embedding_bags." in k}
    assert len(tables) == 26 and len(first) > len(tables)
    for key, shard in tables.items():
        name = key.split("embedding_bags.")[1].split(".")[0]
        cfg = EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=3000, feature_names=["f"])
        assert torch.equal(shard, init_table_slice(cfg, 0, (0, 3000), (0, dim))), key
    assert len(summary.losses) == 3 and all(math.isfinite(loss) for loss in summary.losses)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["model=dlrm_torch"], "model.table_init"),
        (
            ["model=dlrm", "model.sharding=row_wise", "data=criteo_synthetic", "data.ids=managed"],
            "model.table_init=per_shard cannot initialise managed-collision tables",
        ),
        (
            ["model=custom", "model.builder=custom_components:build_vocab_dependent_model", "data=criteo_synthetic"],
            "error: model.table_init: per_shard: model 'custom_components:build_vocab_dependent_model' has "
            "parameters outside its torchrec tables whose shape depends on the vocabulary sizes (row_bias)",
        ),
    ],
    ids=["plain torch tables", "managed", "vocabulary-sized dense parameter"],
)
def test_what_per_shard_cannot_serve_exits_2_in_one_line(overrides, fragment, tmp_path, capsys, no_process_group):
    """`recsys-train --check`: before any process group starts."""
    code = train_cli.run([*overrides, "model.table_init=per_shard", f"hydra.run.dir={tmp_path}", "--check"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err


def test_recsys_train_check_refuses_per_shard_with_pipeline_stages(tmp_path, capsys, monkeypatch, no_process_group):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["parallel.pp.size=2", "model.table_init=per_shard", f"hydra.run.dir={tmp_path}", "--check"]
    assert train_cli.run(argv) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error: ")][0].startswith(
        "error: model.table_init: per_shard is not offered with pipeline stages"
    ), err


def test_a_resume_does_not_care_how_the_tables_were_initialised():
    """`model.table_init` decides only the initial weights, which a checkpoint replaces: it is not
    part of the experiment's fingerprint (`trainer.resume_from=latest` takes the checkpoints of
    either setting, and of runs from before the key existed)."""
    from recsys_pipe.testing import load_run
    from recsys_pipe.train.fingerprint import fingerprint

    unsharded = fingerprint(load_run("model=dlrm"), 2)
    assert "table_init" not in unsharded.model and "sharding" in unsharded.model
    assert fingerprint(load_run("model=dlrm", "model.table_init=per_shard"), 2) == unsharded
