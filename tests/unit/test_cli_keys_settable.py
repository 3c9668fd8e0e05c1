"""Every key `recsys-train --help` lists can be set from the command line as printed, nested
mapping keys included (`data.columns.sparse.<name>.num_embeddings`), for every data source and
model option; a misspelt key is named as typed, and its "did you mean" never proposes the key
that was refused."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf, open_dict

from recsys_pipe.cli import train as train_cli
from recsys_pipe.cli.compose import compose_config
from recsys_pipe.cli.keys import closest_keys, describe_keys, format_keys
from recsys_pipe.train.config import RunConfig

#: every data option (with a model that reads it) and every model option (with its default data);
#: those that list no key another choice does not (sequences, dlrm_torch, hstu_retrieval_large) left out
CHOICES = [
    ["model=dlrm", "data=criteo", "data.path=x.tsv"],
    ["model=dlrm", "data=criteo_synthetic"],
    ["model=dlrm", "data=parquet", "data.path=x.parquet", "+data.columns.sparse.f.num_embeddings=5"],
    ["model=sasrec", "data=parquet_sequences", "data.path=x.parquet"],
    ["model=hstu_small", "data=movielens", "data.path=x.dat"],
    ["model=hstu_small", "data=synthetic"],
    ["model=dlrm_dcn"],
    ["model=hstu_retrieval"],
]


def _listed(choice: list[str]) -> tuple[list[tuple[str, str, str]], dict]:
    """The rows `--help` lists for these overrides (`HydraApp._print_keys`), and the config."""
    cfg = compose_config(*choice, config_name="train")
    with open_dict(cfg):
        del cfg["hydra"]
    values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    return describe_keys(RunConfig, values), values


def _named(path: str, values: dict) -> str:
    """`path` with each `<name>` replaced by the first entry of that map in `values`."""
    head, _, rest = path.partition(".<name>")
    if not rest:
        return path
    entries = OmegaConf.select(OmegaConf.create(values), head)
    return _named(f"{head}.{next(iter(entries))}{rest}", values)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: " ".join(c[:2]))
def test_every_listed_key_is_settable_as_printed(choice, capsys):
    """The first choice sets every key; the others the keys of the model and data they choose
    (the other sections list the same keys whatever the choice)."""
    rows, values = _listed(choice)
    assert train_cli.run([*choice, "--help"]) == 0
    printed = capsys.readouterr().out
    assert format_keys(rows) in printed  # the rows below are what --help prints
    if choice is not CHOICES[0]:
        rows = [row for row in rows if row[0].startswith(("model.", "data."))]
    settable = [(_named(p, values), v) for p, v, _ in rows if v and v != "???"]
    assert any(".<name>." in p for p, _, _ in rows) or "data=parquet" not in choice
    overrides = [f"{path}={value}" for path, value in settable]
    assert train_cli.run([*choice, *overrides, "--cfg", "job"]) == 0, capsys.readouterr().err
    composed = OmegaConf.create(capsys.readouterr().out)
    for path, value in settable:
        assert OmegaConf.select(composed, path, throw_on_missing=False) is not None or value == "null", path


def test_a_nested_mapping_key_is_set_without_plus(no_process_group, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"click": [0, 1] * 64, "user_id": list(range(128))}), tmp_path / "c.parquet")
    common = ["model=dlrm", "data=parquet", f"data.path={tmp_path / 'c.parquet'}", "data.columns.labels=[click]"]
    common += [f"trainer.output_dir={tmp_path / 'runs'}", "data.batch_size=8", "trainer.eval_batches=1"]
    assert train_cli.run(["--check", *common, "data.columns.sparse.user.column=user_id"]) == 2  # no num_embeddings
    assert "data.columns.sparse.user.num_embeddings: " in capsys.readouterr().err
    args = ["data.columns.sparse.user.column=user_id", "data.columns.sparse.user.num_embeddings=10"]
    assert train_cli.run(["--check", *common, *args]) == 0, capsys.readouterr().err
    capsys.readouterr()  # what the passing check printed (a library's warning, say) is not the next one's
    assert train_cli.run(["--check", *common, "data.columns.sparse.user.num_embedings=10"]) == 2
    (line, *_) = capsys.readouterr().err.splitlines()
    expected = "data.columns.sparse.user.num_embedings: unknown key (did you mean data.columns.sparse.user."
    assert line == f"error: {expected}num_embeddings?)"


def test_did_you_mean_never_proposes_the_refused_key():
    values = {"data": {"columns": {"labels": ["x"]}}, "optimizer": {"sparse": {}}}
    for path in ("data.columns.sparse", "optimizer.sparse"):
        assert path not in closest_keys(path, values, RunConfig)
