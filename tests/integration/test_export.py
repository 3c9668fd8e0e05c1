"""`recsys-export RUN_DIR OUT` and `recsys-eval RUN_DIR` on the same trained runs.

`recsys-export`: a trained run's model as a `torch.export` program that loads and
scores in a fresh interpreter where neither recsys_pipe nor torchrec can be imported.

Tolerance: 1e-5 (the issue's bar) between the program's scores and the trained model's. The
2-rank DLRM run shards its tables over the ranks (table-wise: each rank's DCP files hold half
of them), so the export must gather them from both ranks' files; the program, fed both ranks'
held-out batches, reproduces the evaluation the training run logged at that checkpoint (log loss
and AUC over the same rows). The fresh interpreter runs the serving snippet of the docs' page.
HSTU ranking's program takes padded sequences and needs no fbgemm, so that check blocks fbgemm too.

`recsys-eval`: under the launcher on the 2 ranks that trained, the metrics of a checkpoint equal
the evaluation the training run logged after that step, exactly (same data, same plan).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _serving_snippet import load_fresh

from recsys_pipe.cli import export as export_cli
from recsys_pipe.testing import worker_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SMOKE = ["trainer=smoke", "trainer.checkpoint.interval=4", "trainer.eval_every=4", "trainer.tensorboard=false"]


def _train(tmp: Path, *overrides: str, nproc: int = 1) -> Path:
    out = tmp / "runs"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    launcher = [*launcher, "--no-python"] if nproc > 1 else []
    proc = subprocess.run(
        [*launcher, str(BIN / "recsys-train"), *SMOKE, f"trainer.output_dir={out}", *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        env=worker_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (out / "recsys-train").iterdir()
    return run_dir


@pytest.fixture(scope="module")
def dlrm_run(tmp_path_factory) -> Path:
    """DLRM (torchrec tables sharded over 2 ranks), 8 steps, checkpoints at 4 and 8."""
    tmp = tmp_path_factory.mktemp("dlrm")
    return _train(tmp, "model=dlrm", "data=criteo_synthetic", "trainer.eval_batches=1", nproc=2)


def test_exported_dlrm_scores_without_recsys_pipe(dlrm_run, tmp_path, capsys):
    out = tmp_path / "served"
    assert export_cli.run([str(dlrm_run), str(out)]) == 0
    assert "exported the ranking model" in capsys.readouterr().out
    described = json.loads((out / "serving.json").read_text())
    assert described["step"] == 8 and described["kind"] == "ranking" and described["max_abs_diff"] <= 1e-5
    got = load_fresh(out)
    assert got["diff"] <= 1e-5 and got["loaded"] == [] and got["n"] == 64


def test_exported_program_reproduces_the_logged_evaluation(dlrm_run, tmp_path):
    """Both ranks' held-out batches through the program: the log loss and AUC training logged at
    step 4 (so the export gathered every shard of every table, of the checkpoint it was asked for)."""
    from torchmetrics.classification import BinaryAUROC

    from recsys_pipe.data import RankData
    from recsys_pipe.train.export import load_run

    out = tmp_path / "served4"
    assert export_cli.run([str(dlrm_run), str(out), "checkpoint=step_4"]) == 0
    program = torch.export.load(str(out / "program.pt2")).module()
    run = load_run(dlrm_run, dlrm_run / "checkpoints" / "step_4", {})
    logits, labels = [], []
    for rank in range(2):
        (batch,) = list(RankData(run.data, rank, 2, eval_batches=1).eval_loader())
        logits.append(program(batch.dense_features, batch.sparse_ids))
        labels.append(batch.labels)
    logits, labels = torch.cat(logits), torch.cat(labels)
    logged = [json.loads(line) for line in (dlrm_run / "metrics.jsonl").read_text().splitlines()]
    (at4,) = [r for r in logged if r["step"] == 4 and "auc" in r]
    log_loss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    assert abs(log_loss - at4["log_loss"]) <= 1e-5
    assert abs(float(BinaryAUROC()(logits[:, 0], labels[:, 0].int())) - at4["auc"]) <= 1e-5


@pytest.fixture(scope="module")
def sasrec_run(tmp_path_factory) -> Path:
    """SASRec on a small "user item" file, one rank, 8 steps, checkpoints at 4 and 8."""
    tmp = tmp_path_factory.mktemp("sasrec")
    lines = [f"{u} {(u * 7 + k) % 30 + 100}" for u in range(1, 41) for k in range(3 + u % 10)]
    (tmp / "seq.txt").write_text("\n".join(lines) + "\n")
    data = ["data=sequences", f"data.path={tmp / 'seq.txt'}", "data.eval_negatives=10", "data.batch_size=4"]
    return _train(tmp, "model=sasrec", *data, "data.max_seq_len=8", "model.max_seq_len=8")


def test_exported_retrieval_encoder_and_item_table(sasrec_run, tmp_path):
    """SASRec: the user encoder program and the item table score the held-out user's candidates
    as the trained model does."""
    run_dir = sasrec_run
    out = tmp_path / "served"
    assert export_cli.run([str(run_dir), str(out)]) == 0
    table = torch.load(out / "item_table.pt")
    assert table.shape == (30, 50)
    got = load_fresh(out)
    assert got["diff"] <= 1e-5 and got["loaded"] == [] and got["n"] == 4


@pytest.fixture(scope="module")
def hstu_run(tmp_path_factory) -> Path:
    """HSTU ranking (the main job's model) with the user token: one step, trained in this
    process (about a second: torch and torchrec are imported already; a launch would import
    them again), a checkpoint at step 1. The run's log handlers and warning filters are taken
    off again, so the tests after it see this process as it was."""
    from recsys_pipe.testing import train_here

    tmp = tmp_path_factory.mktemp("hstu")
    args = [*SMOKE, "trainer.max_steps=1", "trainer.checkpoint.interval=1", "trainer.eval_every=0"]
    args += ["trainer.eval_batches=1", "data.num_batches=8", "data.use_user_feature=true"]
    assert train_here(*args, f"trainer.output_dir={tmp / 'runs'}") == 0
    (run_dir,) = (tmp / "runs" / "recsys-train").iterdir()
    return run_dir


def test_exported_hstu_ranking_scores_candidates_without_recsys_pipe(hstu_run, tmp_path):
    """Padded sequences and the candidate counts in, per-candidate logits out: the trained
    model's scores, with neither recsys_pipe, torchrec nor fbgemm importable."""
    out = tmp_path / "served"
    assert export_cli.run([str(hstu_run), str(out)]) == 0
    described = json.loads((out / "serving.json").read_text())
    assert list(described["inputs"]) == ["items", "actions", "timestamps", "lengths", "num_candidates", "users"]
    assert described["inputs"]["items"]["shape"] == [32, 32] and described["max_abs_diff"] <= 1e-5
    inputs, expected = torch.load(out / "example_inputs.pt"), torch.load(out / "expected_scores.pt")["scores"]
    counts = inputs["num_candidates"]
    scored = expected.ne(0).any(-1)  # a candidate's logits are never exactly zero on both tasks
    assert scored.sum() == counts.sum() and scored.sum(1).eq(counts).all()
    got = load_fresh(out)
    assert got["diff"] <= 1e-5 and got["loaded"] == [] and got["n"] == 32


def test_export_refusals_are_one_line(dlrm_run, tmp_path, capsys):
    assert export_cli.run([str(dlrm_run), str(tmp_path / "o"), "checkpoint=step_5"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"error: checkpoint: {dlrm_run} has no checkpoint 'step_5' (it has step_4, step_8)"
    assert export_cli.run([str(tmp_path), str(tmp_path / "o")]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err
    assert export_cli.run([str(dlrm_run), str(tmp_path / "o"), "model.embedding_dim=-1"]) == 2
    assert capsys.readouterr().err.startswith("error: model.embedding_dim:")


# -- recsys-eval: the training run's evaluation again, on a checkpoint ---------------------------


def _eval(run_dir: Path, *args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "recsys_pipe.runtime.launcher", "--standalone", "--nproc_per_node", str(nproc)]
    command = [*launcher, "--no-python"] if nproc > 1 else []
    return subprocess.run(
        [*command, str(BIN / "recsys-eval"), str(run_dir), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=worker_env(),
    )


def _logged(run_dir: Path, step: int) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (record,) = [r for r in records if r["step"] == step and ("auc" in r or "valid" in r)]
    return record


def test_recsys_eval_on_two_ranks_equals_the_logged_evaluation(dlrm_run):
    """torchrun's 2 ranks, as trained: AUC and losses of step 4's checkpoint, as logged then."""
    proc = _eval(dlrm_run, "checkpoint=step_4", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evaluated = json.loads((dlrm_run / "eval.json").read_text())
    logged = _logged(dlrm_run, 4)
    assert evaluated["world_size"] == 2 and evaluated["checkpoint"].endswith("checkpoints/step_4")
    for key in ("eval_loss", "log_loss", "auc", "auc_per_task"):
        assert evaluated[key] == logged[key], key
    line = f"eval at step 4: loss {logged['eval_loss']:.4f}, auc {logged['auc']:.4f}"
    assert line in proc.stderr and "Traceback" not in proc.stderr


def test_recsys_eval_of_a_retrieval_run_gives_both_protocols(sasrec_run):
    proc = _eval(sasrec_run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evaluated = json.loads((sasrec_run / "eval.json").read_text())
    logged = _logged(sasrec_run, 8)
    for split in ("valid", "test"):
        assert evaluated[split] == logged[split]  # sampled and full, HR/NDCG/MRR
    assert set(evaluated["valid"]) == {"sampled", "full"}
    assert "eval at step 8: valid/sampled HR@10 " in proc.stderr


def test_recsys_eval_refuses_a_missing_checkpoint_in_one_line(dlrm_run, capsys):
    from recsys_pipe.cli import eval as eval_cli

    assert eval_cli.run([str(dlrm_run), "checkpoint=step_3"]) == 2  # before any process group
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"error: checkpoint: {dlrm_run} has no checkpoint 'step_3' (it has step_4, step_8)"
