"""Managed-collision tables (`ids: managed`, docs/raw-ids.md) through every shipped plan, a
resume and an evaluation, on 1 and 2 forked ranks (gloo, CPU): `tests/dist/raw_ids_worker.py`.

Tolerance: bitwise, as in test_train_parity: on the CPU every plan performs the same operations
in the same order on the same batches, the remapping and the evictions included.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from _serving_snippet import load_fresh

from recsys_pipe.testing import fork_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist" / "raw_ids_worker.py"


def _launch(out: Path, nproc: int, *parts: str) -> list[dict]:
    proc = fork_ranks(WORKER, str(out), *parts, nproc=nproc, timeout=500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("raw_ids2"), 2, "plans", "resume", "eval")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("raw_ids1"), 1, "plans")


@pytest.fixture(params=["one_rank", "two_ranks"])
def ranks(request):
    return request.getfixturevalue(request.param)


def test_every_plan_trains_the_serial_plans_numbers_with_managed_tables(ranks):
    """Per-step losses, trained batches and every local tensor (dense weights, table shards and
    the remapping with its counts or ages) equal the serial plan's (or, for the balanced plans,
    the balanced serial plan's) while ids are evicted."""
    for data in ranks:
        plans = data["plans"]
        for name, got in plans.items():
            reference = got.get("reference")
            if reference is None or name.startswith("stale/"):
                continue
            ref = plans[reference]
            assert got["losses"] == ref["losses"], f"{name}: losses differ from {reference}"
            assert got["sample_ids"] == ref["sample_ids"], f"{name}: trained other batches"
            assert got["params"] == ref["params"], f"{name}: final tensors differ from {reference}"
            assert got["evicted_rows"] > 0, f"{name}: no row was re-initialised: the tables evicted nothing"
        assert len(plans["dlrm/serial"]["losses"]) == 6 and len(plans["dlrm/serial"]["params"]) > 20


def test_retrieval_negatives_are_looked_up_in_the_managed_table_without_counting(ranks):
    """SASRec and HSTU retrieval on raw ids: the ids the item table counted for eviction since its
    last eviction were all inputs or targets of those steps' batches; their sampled negatives that
    were neither (there are such) were looked up in the same table but not counted."""
    for data in ranks:
        for name in ("sasrec/serial", "hstu_retrieval/serial"):
            counted = data["plans"][name]["counted_unseen"]
            assert counted["unseen"] == 0 and counted["counted"] > 20, (name, counted)
            assert counted["negatives_only"] > 20, (name, counted)


def test_semi_synchronous_plans_match_the_stale_embedding_loop(ranks):
    """semi_sync and semi_sync_stash look batch i up in the tables from before batch i-1's update;
    with tables that admit every id (no row a batch updated is re-initialised by the next one's
    lookup), they equal the plain loop of that staleness bitwise. With evicting tables their two
    executors agree (test above) and differ from the serial plan (the staleness is real)."""
    for data in ranks:
        plans = data["plans"]
        for name in ("stale/semi_sync", "stale/semi_sync_stash"):
            ref = plans[plans[name]["reference"]]
            assert plans[name]["losses"] == ref["losses"], name
            assert plans[name]["sample_ids"] == ref["sample_ids"], name
            assert plans[name]["params"] == ref["params"], name
        assert plans["hstu/semi_sync"]["losses"][1:] != plans["hstu/serial"]["losses"][1:]


def test_resume_mid_eviction_interval_is_bitwise_the_unbroken_run(two_ranks):
    """Resumed from step 4 of an eviction interval of 3 (ids counted since the eviction at step
    3 are in the rank's own checkpoint file): steps 5-6 and every final tensor equal the unbroken
    run's, for serial, pipelined and semi-synchronous plans. Without those counted ids (the
    control) the run differs: the test is not vacuous."""
    for data in two_ranks:
        for name, got in data["resume"].items():
            unbroken, resumed = got["unbroken"], got["resumed"]
            assert resumed["losses"] == unbroken["losses"][4:], f"{name}: losses"
            assert resumed["sample_ids"] == unbroken["sample_ids"][4:], f"{name}: batches"
            assert resumed["params"] == unbroken["params"], f"{name}: final tensors"
            assert got["control"]["params"] != unbroken["params"], f"{name}: the control resume changed nothing"


def test_evaluation_looks_ids_up_without_counting_or_evicting(two_ranks):
    for data in two_ranks:
        assert data["evaluation"]["changed"] == [] and data["evaluation"]["tensors"] > 20


def test_each_rank_remaps_the_raw_ids_of_its_slice_of_the_id_space(two_ranks):
    """Row-wise: rank r's shard holds raw ids of the r-th half of [0, input_hash_size) only, in
    the r-th half of the rows (the remapping runs on the rank that owns the ids, after the
    input all-to-all, as torchrec's sharded module runs it)."""
    for rank, data in enumerate(two_ranks):
        layout = data["layout"]
        assert layout["ids"] and all(rank * layout["block"] <= i < (rank + 1) * layout["block"] for i in layout["ids"])
        assert layout["offset"] == rank * 12  # 24 rows, 12 per rank


# -- a trained run with managed tables: export, recsys-eval, resume on another rank count ----------

TRAIN = [
    "trainer=smoke",
    "trainer.checkpoint.interval=4",
    "trainer.eval_every=4",
    "trainer.eval_batches=1",
    "trainer.tensorboard=false",
    "model=dlrm",
    "model.sharding=row_wise",
    "data=criteo_synthetic",
    "data.ids=managed",
    "data.num_embeddings=24",
    "data.managed.eviction_policy=distance_lfu",
    "data.managed.eviction_interval=2",
]


@pytest.fixture(scope="module")
def managed_run(tmp_path_factory) -> Path:
    """DLRM with managed tables sharded row-wise over 2 ranks (recsys-train as 2 forked ranks),
    8 steps, checkpoints and evaluations at 4 and 8."""
    out = tmp_path_factory.mktemp("managed") / "runs"
    proc = fork_ranks(Path(sys.executable).parent / "recsys-train", *TRAIN, f"trainer.output_dir={out}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (out / "recsys-train").iterdir()
    return run_dir


def test_exported_program_remaps_raw_ids_as_the_trained_model(managed_run, tmp_path):
    """The program takes raw ids and remaps them itself: fed both ranks' held-out batches (raw
    ids, some without a row: each rank's shard has its own shared row), it reproduces the log
    loss and AUC the 2-rank sharded model logged at step 4 within 1e-5; and the docs' serving
    snippet on raw rows (`preprocess.py` passes managed ids on as raw ids), in an interpreter
    where recsys_pipe, torchrec and fbgemm cannot be imported, gives the trained scores."""
    from torchmetrics.classification import BinaryAUROC

    from recsys_pipe.cli import export as export_cli
    from recsys_pipe.data import RankData
    from recsys_pipe.train.export import load_run

    out = tmp_path / "served4"
    assert export_cli.run([str(managed_run), str(out), "checkpoint=step_4"]) == 0
    program = torch.export.load(str(out / "program.pt2")).module()
    run = load_run(managed_run, managed_run / "checkpoints" / "step_4", {})
    logits, labels = [], []
    for rank in range(2):
        (batch,) = list(RankData(run.data, rank, 2, eval_batches=1).eval_loader())
        assert int(batch.sparse_ids.max()) >= 2**16  # raw 32-bit ids, not rows
        logits.append(program(batch.dense_features, batch.sparse_ids))
        labels.append(batch.labels)
    logits, labels = torch.cat(logits), torch.cat(labels)
    logged = [json.loads(line) for line in (managed_run / "metrics.jsonl").read_text().splitlines()]
    (at4,) = [r for r in logged if r["step"] == 4 and "auc" in r]
    log_loss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    assert abs(log_loss - at4["log_loss"]) <= 1e-5
    assert abs(float(BinaryAUROC()(logits[:, 0], labels[:, 0].int())) - at4["auc"]) <= 1e-5
    record = json.loads((out / "features.json").read_text())["features"]["cat_0"]["ids"]
    assert record == {"mapping": "managed", "num_embeddings": 24, "input_hash_size": 2**32, "strings": "fnv1a64"}
    got = load_fresh(out)
    assert got["diff"] <= 1e-5 and got["loaded"] == []


def test_recsys_eval_on_the_ranks_that_trained_equals_the_logged_evaluation(managed_run):
    """recsys-eval of step 4 on the 2 ranks that trained: the remapping is looked up as in the
    training run's evaluation (nothing counted or evicted since), so the metrics are the same."""
    proc = fork_ranks(Path(sys.executable).parent / "recsys-eval", str(managed_run), "checkpoint=step_4", timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evaluated = json.loads((managed_run / "eval.json").read_text())
    logged = [json.loads(line) for line in (managed_run / "metrics.jsonl").read_text().splitlines()]
    (at4,) = [r for r in logged if r["step"] == 4 and "auc" in r]
    assert evaluated["world_size"] == 2
    for key in ("eval_loss", "log_loss", "auc"):
        assert evaluated[key] == at4[key], key


def test_another_rank_count_is_refused_in_one_line(managed_run, capsys, monkeypatch):
    """The remapping is not resharded: recsys-eval and a resume on 1 rank (of 2 that trained)
    are refused before anything starts."""
    from recsys_pipe.cli import eval as eval_cli
    from recsys_pipe.cli import train as train_cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert eval_cli.run([str(managed_run), "checkpoint=step_4"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert (
        err[0].startswith("error: checkpoint: checkpoint ") and "(ids=managed) of 2 rank(s), this run has 1" in err[0]
    )
    assert train_cli.run(["--check", *TRAIN, f"trainer.resume_from={managed_run}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: trainer.resume_from: checkpoint ") and "run on 2 rank(s)" in err[0]


@pytest.mark.parametrize("data", ["synthetic", "parquet_sequences"])
def test_exported_hstu_remaps_managed_items_and_users(tmp_path, data):
    """HSTU ranking with managed items and users (one rank, trained in this process), on
    generated data and on Parquet windows of raw 64-bit ids: the program takes raw item and user
    ids and scores the candidates as the trained model; `preprocess.py` passes the rows' raw ids on."""
    from recsys_pipe.cli import export as export_cli
    from recsys_pipe.testing import raw_id_windows, train_here

    args = ["trainer=smoke", "trainer.max_steps=2", "trainer.checkpoint.interval=2", "trainer.eval_every=0"]
    args += ["trainer.eval_batches=1", "trainer.tensorboard=false", "data.batch_size=16"]
    if data == "synthetic":
        args += ["data.num_batches=8", "data.use_user_feature=true", "data.ids=managed", "data.item_rows=64"]
        args += ["model.sharding=row_wise"]
    else:
        args += raw_id_windows(tmp_path / "windows.parquet")
    assert train_here(*args, f"trainer.output_dir={tmp_path / 'runs'}") == 0
    (run_dir,) = (tmp_path / "runs" / "recsys-train").iterdir()
    out = tmp_path / "served"
    assert export_cli.run([str(run_dir), str(out)]) == 0
    inputs = torch.load(out / "example_inputs.pt")
    assert int(inputs["items"].max()) > 2**40 and int(inputs["users"].max()) > 2**40  # raw ids
    got = load_fresh(out)
    assert got["diff"] <= 1e-5 and got["loaded"] == []


def test_retrieval_on_raw_ids_exports_and_evaluates_as_trained(tmp_path, monkeypatch):
    """HSTU retrieval with a managed item table on sequence Parquet of raw 64-bit item ids (one
    rank, trained in this process; data=sequences' item record: test_managed_ids): the
    exported program takes raw item ids and scores the catalogue as the trained model (the docs'
    snippet in a torch-only interpreter: top-10 items as raw ids of the catalogue), and
    recsys-eval of the checkpoint gives the metrics the run logged."""
    from recsys_pipe.cli import eval as eval_cli
    from recsys_pipe.cli import export as export_cli
    from recsys_pipe.testing import raw_id_sequences, train_here

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = ["trainer=smoke", "trainer.max_steps=4", "trainer.checkpoint.interval=4", "trainer.eval_every=4"]
    args += ["trainer.tensorboard=false", "data.batch_size=16", "data.managed.eviction_interval=2"]
    args += ["model=hstu_retrieval", *raw_id_sequences(tmp_path / "users.parquet")]
    assert train_here(*args, f"trainer.output_dir={tmp_path / 'runs'}") == 0
    (run_dir,) = (tmp_path / "runs" / "recsys-train").iterdir()
    out = tmp_path / "served"
    assert export_cli.run([str(run_dir), str(out)]) == 0
    record = json.loads((out / "features.json").read_text())["features"]["item"]["ids"]
    assert record["mapping"] == "managed" and record["num_embeddings"] == 24
    catalogue = record["catalogue"]
    assert len(catalogue) > 100 and min(catalogue) > 2**40  # the raw ids the file holds
    assert torch.load(out / "item_table.pt").shape[0] == len(catalogue)
    assert int(torch.load(out / "example_inputs.pt")["items"].max()) > 2**40
    got = load_fresh(out)
    assert got["diff"] <= 1e-5 and got["loaded"] == []
    assert eval_cli.run([str(run_dir), "checkpoint=step_4"]) == 0
    evaluated = json.loads((run_dir / "eval.json").read_text())
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (at4,) = [r for r in logged if r["step"] == 4 and "valid" in r]
    assert evaluated["valid"]["full"]["HR@10"] > 0
    assert {k: evaluated[k] for k in ("valid", "test")} == {k: at4[k] for k in ("valid", "test")}
