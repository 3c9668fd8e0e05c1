"""`recsys-train` with `parallel.pp`: the main job's model (HSTU ranking), SASRec and HSTU retrieval train split
into stages on 2 gloo ranks, every step's loss (metrics.jsonl) bitwise equal to the same model
and microbatching on one rank (`parallel.pp.size=1`), with the batch-level plan (the default,
hstu_prefetch) still preparing the next batches ahead; the evaluations (forward through the
stages: HSTU's AUC, the retrieval models' HR/NDCG/MRR) equal too. With data parallelism, the
first stage's tables are sharded over its replicas and get an unpipelined run's gradients."""

import json
import sys
from pathlib import Path

import pytest

from recsys_pipe.testing import fork_ranks
from recsys_pipe.train.checkpoint import read_metadata

pytestmark = pytest.mark.slow  # multi-rank runs (forked ranks: `fork_ranks`)

BIN = Path(sys.executable).parent  # the environment's console scripts, on PATH or not

COMMON = [
    "parallel.pp.microbatches=4",
    "trainer.eval_every=2",
    "trainer.eval_batches=2",
    "trainer.max_steps=5",
    "trainer.log_every=1",
    "trainer.progress_bar=false",
    "trainer.device=cpu",
]


def _train(out: Path, nproc: int, *overrides: str) -> list[dict]:
    """Train; the records of metrics.jsonl: each step's loss, each evaluation's loss, log loss
    and AUC (timings left out)."""
    proc = fork_ranks(BIN / "recsys-train", *COMMON, *overrides, f"trainer.output_dir={out}", nproc=nproc, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (metrics,) = out.glob("recsys-train/*/metrics.jsonl")
    keys = ("step", "loss", "eval_loss", "log_loss", "auc", "users", "valid", "test")  # ranking's, retrieval's
    return [{k: r[k] for k in keys if k in r} for r in map(json.loads, metrics.read_text().splitlines())]


def _steps(records: list[dict]) -> int:
    return sum("loss" in r for r in records)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("pp1"), 1, "model.num_layers=4", "parallel.pp.size=1")


ZB_H2 = ["model.num_layers=4", "parallel.pp.size=2", "parallel.pp.schedule=zb_h2", "parallel.pp.layers=[3,1]"]


def test_pipelined_recsys_train_is_bitwise_the_one_rank_run_and_resumes_bitwise(tmp_path, one_rank):
    """ZB-H2 as an engine plan with an uneven split; checkpointed every 2 steps, and resumed from
    step 2's checkpoint in a new job, which trains steps 3-5 bitwise as the uninterrupted run."""
    records = _train(tmp_path / "full", 2, *ZB_H2, "trainer.checkpoint.interval=2")
    assert _steps(records) == 5 and sum("auc" in r for r in records) == 4  # steps 0, 2, 4, 5
    assert records == one_rank  # the training losses and the evaluations (forward through the stages)
    (checkpoint,) = (tmp_path / "full").glob("recsys-train/*/checkpoints/step_2")
    resumed = _train(tmp_path / "resumed", 2, *ZB_H2, f"trainer.resume_from={checkpoint}")
    assert resumed == [r for r in one_rank if r["step"] > 2]


def test_a_schedule_csv_runs_in_action_order_bitwise_the_one_rank_run(tmp_path, one_rank):
    """The action-order mode through recsys-train: a schedule CSV in torch's format (DualPipeV's
    order, 4 stages folded into a V over 2 ranks, written by our generator). The named
    multi-stage schedules run the same mode (tests/integration/test_pp_parity.py: bitwise
    against torch's own classes)."""
    from recsys_pipe.pp_schedules.actions import to_csv
    from recsys_pipe.pp_schedules.generators import build

    schedule = str(tmp_path / "dualpipev.csv")
    to_csv(build("dualpipev", 2, 4), schedule)
    records = _train(tmp_path, 2, "model.num_layers=4", "parallel.pp.size=2", f"parallel.pp.schedule={schedule}")
    assert _steps(records) == 5 and records == one_rank


RETRIEVAL = {
    # SASRec (its item table tied to the loss on the last stage), 1F1B, dropout on (attention weights' too)
    "sasrec": (["model=sasrec", "model.num_blocks=2", "model.dropout=0.2"], "1f1b"),
    # HSTU retrieval with dropout on (keyed sites), ZB-H1: the weight gradients split off
    "hstu_retrieval": (
        ["model=hstu_retrieval", "model.num_layers=2", "model.dropout=0.2", "model.num_negatives=32"],
        "zb_h1",
    ),
}


@pytest.fixture(scope="module")
def sequences(tmp_path_factory) -> list[str]:
    """`data=sequences` overrides for a file of 200 users' item sequences, evaluated under both
    protocols (with `data.full_eval` the catalogue's rows travel to the last stage too)."""
    import torch

    g = torch.Generator().manual_seed(0)
    lines = []
    for u in range(1, 201):
        n, start = int(torch.randint(3, 20, (1,), generator=g)), int(torch.randint(0, 80, (1,), generator=g))
        lines += [f"{u * 7} {(start + k) % 80 + 100}" for k in range(n)]
    data = tmp_path_factory.mktemp("sequences") / "seq.txt"
    data.write_text("\n".join(lines) + "\n")
    return ["data=sequences", f"data.path={data}", "data.eval_negatives=20", "data.batch_size=32"] + [
        "data.full_eval=true"
    ]


@pytest.mark.parametrize("model", list(RETRIEVAL))
def test_pipelined_retrieval_models_are_bitwise_the_one_rank_run(tmp_path, model, sequences):
    overrides, schedule = RETRIEVAL[model]
    overrides = [*overrides, *sequences]
    one = _train(tmp_path / "one", 1, *overrides, "parallel.pp.size=1")
    two = _train(tmp_path / "two", 2, *overrides, "parallel.pp.size=2", f"parallel.pp.schedule={schedule}")
    evaluations = [r for r in one if "valid" in r]
    assert _steps(one) == 5 and [r["step"] for r in evaluations] == [0, 2, 4, 5]
    assert evaluations[0]["users"] == {"valid": 200, "test": 200} and "full" in evaluations[0]["test"]
    assert two == one  # losses, and every evaluation's ranks: each user once, ranked by the last stage


#: 2 replicas of the first stage, its tables split by rows over them (each holds half of every
#: table and of its optimizer state); SGD, which (unlike Adam) a gradient's scale changes
DP = ["trainer.eval_every=0", "trainer.eval_epochs=0", "model.sharding=row_wise", "optimizer=sgd"]
DP += ["optimizer.momentum=0.9"]  # eval off: world means of eval metrics round differently


@pytest.fixture(scope="module")
def dp_only(tmp_path_factory):
    """2 replicas of one stage, 4 microbatches each."""
    return _train(tmp_path_factory.mktemp("dp"), 2, "parallel.pp.size=1", *DP)


def test_pp_times_dp_on_4_ranks_is_bitwise_dp_alone_on_2_and_resumes_bitwise(tmp_path, dp_only):
    """2 stages x 2 replicas (each pipeline reads its replica's share of the data) against the
    same microbatching with 2 replicas of one stage; the logged loss is the replicas' mean.
    Resumed from step 2's checkpoint (each replica's rows of the tables and of their momentum
    buffers), steps 3-5 train bitwise alike."""
    pp_dp = [*DP, "parallel.pp.size=2", "parallel.pp.schedule=1f1b"]
    records = _train(tmp_path / "ppdp", 4, *pp_dp, "trainer.checkpoint.interval=2")
    assert _steps(dp_only) == 5 and records == dp_only
    (checkpoint,) = (tmp_path / "ppdp").glob("recsys-train/*/checkpoints/step_2")
    saved = read_metadata(checkpoint).state_dict_metadata
    table = "stages.0.ec.embeddings.item_table.weight"
    for key in (f"train.model.{table}", f"train.optim.optimizer.state.{table}.momentum_buffer"):
        assert [c.offsets[0] for c in saved[key].chunks] == [0, saved[key].size[0] // 2], key  # a row shard each
    resumed = _train(tmp_path / "resumed", 4, *pp_dp, f"trainer.resume_from={checkpoint}")
    assert resumed == [r for r in dp_only if r["step"] > 2]


def test_the_sharded_tables_gradients_are_those_of_an_unpipelined_run(tmp_path, dp_only):
    """The tables' gradients are summed over the replicas by torchrec's backward, as in an
    unpipelined run (one microbatch, `model.compute_kernel=dense`, DDP for the dense weights):
    the losses agree to rounding (4 microbatches' mean against the batch's); had the stages
    averaged the tables' gradients as well, they would differ by 2e-4 at step 2, 1.5e-3 at step 5."""
    plain = _train(tmp_path, 2, *DP, "parallel.pp.size=1", "parallel.pp.microbatches=1", "model.compute_kernel=dense")
    assert [r["step"] for r in plain] == [r["step"] for r in dp_only]
    assert all(abs(a["loss"] - b["loss"]) < 1e-6 for a, b in zip(plain, dp_only, strict=True))


def test_recsys_profile_draws_each_ranks_pipeline_timeline_and_bubble(tmp_path):
    overrides = [c for c in COMMON if not c.startswith(("trainer.max_steps", "trainer.log_every", "trainer.eval"))]
    overrides += ["trainer.eval_every=0", "trainer.eval_epochs=0"]
    profile = ["profile.exposed=false", "profile.iters=3", "profile.warmup=1", "profile.rounds=1"]
    proc = fork_ranks(
        BIN / "recsys-profile",
        *overrides,
        *profile,
        "parallel.pp.size=2",
        "parallel.pp.schedule=zb_h1",
        f"trainer.output_dir={tmp_path}",
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = tmp_path.glob("recsys-profile/*")
    report = json.loads((run_dir / "pp_timeline.json").read_text())
    assert report["schedule"] == "zb_h1" and [r["rank"] for r in report["ranks"]] == [0, 1]
    for rank in report["ranks"]:
        assert 0 < rank["busy_ms"] <= report["measured_step_ms"] and rank["bubble_ms"] >= 0
    assert report["simulated_step_ms"] > 0
    assert (run_dir / "pp_timeline.png").stat().st_size > 1000 and (run_dir / "pp_simulated.png").is_file()
    assert "rank 1: busy" in proc.stdout


def test_pp_times_dp_evaluates_a_retrieval_model_counting_each_user_once(tmp_path, sequences):
    """SASRec on 2 stages x 2 replicas, its table split by rows over the replicas: every
    evaluation (each replica's users ranked by its last stage, the catalogue looked up through
    the sharded table) equals 2 replicas of one stage, every user counted once."""
    sasrec = [*RETRIEVAL["sasrec"][0], *sequences, *DP[2:]]  # training as DP's, evaluation on
    dp = _train(tmp_path / "dp", 2, *sasrec, "parallel.pp.size=1")
    pp_dp = _train(tmp_path / "ppdp", 4, *sasrec, "parallel.pp.size=2", "parallel.pp.schedule=1f1b")
    evaluations = [r for r in dp if "valid" in r]
    assert [r["step"] for r in evaluations] == [0, 2] and evaluations[-1]["users"] == {"valid": 200, "test": 200}
    assert pp_dp == dp
