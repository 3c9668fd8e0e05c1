"""Checkpoint and resume on 2 ranks (torchrun, gloo, CPU): a resumed run continues bitwise.

Tolerance: bitwise (torch.equal / identical floats), as in the parity tests: CPU kernels are
deterministic, so a resumed run that differs in any bit trained another batch, with another
optimizer, LR schedule or RNG state than the uninterrupted run.

The configuration makes every piece of state matter: Adam moments, rowwise-Adagrad table state,
a cosine LR schedule with warmup, gradient clipping, dropout (RNG), two shuffled epochs (resumes
land mid-epoch 1 and cross into epoch 2) and evaluations between steps.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsys_pipe.testing import FAULT_ENV, FAULT_OVERRIDE, check_torchrun, fork_ranks, read_rank_results, worker_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist" / "resume_worker.py"
BIN = Path(sys.executable).parent
PLANS = ["serial", "hstu_sparse_dist", "hstu_prefetch"]
CONFIG = [
    "trainer=smoke",
    "trainer.max_steps=30",
    "trainer.log_every=1",
    "trainer.eval_every=10",
    "trainer.eval_batches=2",
    "trainer.epochs=2",
    "trainer.tensorboard=false",
    "trainer.checkpoint.interval=10",
    "data.batch_size=16",
    "data.num_batches=20",
    "data.shuffle=true",
    "model.dropout=0.1",
    "optimizer=adam",
    "optimizer.schedule=cosine",
    "optimizer.warmup_steps=5",
    "optimizer.clip_grad_norm=0.5",
]
TIMEOUT = 240


# -- in-process resume (tests/dist/resume_worker.py) ------------------------------------------


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    check_torchrun(fork_ranks(WORKER, "main", str(out), timeout=TIMEOUT))
    return out, read_rank_results(out)


def test_resume_is_bitwise_for_every_plan_and_async_save(plain):
    _, ranks = plain
    for data in ranks:
        ref = data["reference"]
        assert len(ref["losses"]) == 30 and ref["evals"] == [0, 10, 20, 30]
        for name, got in data["plans"].items():
            assert got["checkpoint"].endswith("checkpoints/step_15"), name
            assert got["first_stop"] == got["stop"] == "max_steps reached"
            assert got["first_losses"] == ref["losses"][:15], name
            assert got["resumed_at"] == 15, name
            assert got["losses"] == ref["losses"][15:], f"{name}: steps 16..30 differ after resume"
            assert got["params"] == ref["params"], f"{name}: final parameters differ after resume"
            assert got["num_params"] > 10  # dense tensors and embedding shards
        assert set(data["plans"]) == {*PLANS, "hstu_prefetch/async"}


def test_epochs_train_every_batch_once_in_order_across_the_boundary(plain):
    """Epoch 2 starts right after epoch 1 in the same pipeline: the 30 trained batches are the
    loader's first 30 (20 of epoch 1, 10 of the reshuffled epoch 2), none lost or repeated."""
    _, ranks = plain
    for data in ranks:
        ref = data["reference"]
        assert ref["sample_ids"] == ref["loader_ids"]
        assert ref["epoch_sizes"] == [320, 320]  # each epoch: 20 batches of 16 distinct samples
        assert ref["loader_ids"][20] != ref["loader_ids"][0]  # epoch 2 is reshuffled


def test_dense_kernel_tables_resume_bitwise_with_their_sharded_adam_moments(plain):
    """`model.compute_kernel=dense`, row-wise: Adam updates the tables, so its moments for them
    are per-rank rows. The checkpoint holds them at the table's whole size (both ranks' rows, not
    one rank's copy) and the resumed run continues bitwise; the kernel switch does change the
    training (another optimizer for the tables)."""
    _, ranks = plain
    for data in ranks:
        dense = data["dense_kernel"]
        assert len(dense["ref_losses"]) == 30
        assert dense["losses"] == dense["ref_losses"]
        assert dense["params"] == dense["ref_params"]
        assert dense["ref_losses"] != data["reference"]["losses"]
        assert dense["tables"] and len(dense["moments"]) == len(dense["tables"])
        for table_key, size in dense["tables"].items():
            fqn = table_key.removeprefix("train.model.")
            (moment,) = [m for m in dense["moments"] if fqn in m]
            assert dense["moments"][moment] == size


def test_per_shard_tables_train_and_resume_bitwise_from_the_drawn_shards(plain):
    """`model.table_init=per_shard`, row-wise over the 2 ranks: the tables built on the meta device
    and each rank drawing its own rows. Both ranks start from the same dense part, their shards
    together are the whole tables as `init_table_slice` draws them (what one rank would hold), and
    the run resumes bitwise; it trains from other initial tables than the unsharded build."""
    from recsys_pipe.models.sharding import embedding_modules, init_table_slice
    from recsys_pipe.testing import load_run
    from recsys_pipe.train.parallel.sharded import meta_model

    out, ranks = plain
    for data in ranks:
        got = data["per_shard"]
        assert len(got["ref_losses"]) == 30 and got["resumed_at"] == 15
        assert got["losses"] == got["ref_losses"] and got["params"] == got["ref_params"]
        assert got["ref_losses"][0] != data["reference"]["losses"][0]
    initial = [torch.load(out / f"rank{r}_per_shard.pt", weights_only=True) for r in range(2)]
    dense = [k for k in initial[0] if "#shard" not in k]
    assert dense and all(torch.equal(initial[0][k], initial[1][k]) for k in dense)
    run = load_run("data.batch_size=16", "data.num_batches=20", "model.table_init=per_shard")
    configs = {c.name: c for m in embedding_modules(meta_model(run)).values() for c in m.embedding_configs()}
    shards = [k for k in initial[0] if k.endswith("#shard0")]
    assert {k.split(".")[-2] for k in shards} == set(configs)
    for key in shards:
        cfg = configs[key.split(".")[-2]]
        whole = torch.cat([initial[0][key], initial[1][key]])
        assert torch.equal(whole, init_table_slice(cfg, run.seed, (0, cfg.num_embeddings), (0, cfg.embedding_dim)))


def test_resume_without_rng_state_is_not_bitwise(plain):
    """Negative control: dropout draws from the RNG, so its restored state is what keeps the
    resumed run bitwise above."""
    _, ranks = plain
    for data in ranks:
        assert len(data["no_rng_losses"]) == 15
        assert data["no_rng_losses"] != data["reference"]["losses"][15:]


def test_two_rank_checkpoint_resumes_on_one_rank(plain, tmp_path):
    """2 -> 1 ranks: DCP reshards the tables (each was on one rank, now both are on rank 0) and
    training continues. Not bitwise: one rank splits the data differently."""
    out, _ = plain
    proc = subprocess.run(
        [sys.executable, str(WORKER), "reshard", str(out / "serial" / "checkpoints" / "step_15"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=worker_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    loaded = torch.load(tmp_path / "resharded.pt")
    saved = [torch.load(out / f"rank{r}_step15.pt") for r in range(2)]
    tables = [k for k in loaded if "#shard" in k]
    assert len(tables) == 2  # item and action tables, both local now
    for key, value in loaded.items():
        holders = [s[key] for s in saved if key in s]
        assert holders, key
        assert all(torch.equal(value, h) for h in holders), key
    report = json.loads((tmp_path / "reshard.json").read_text())
    assert report["start"] == [15, 15]  # step 15: 15 of 20 batches of epoch 1, the same share of 1 rank's epoch
    assert report["end_step"] == 20 and len(report["losses"]) == 5
    assert all(0 < loss < 10 for loss in report["losses"])


def test_two_rank_dense_kernel_checkpoint_resumes_on_one_rank(plain, tmp_path):
    """2 -> 1 ranks with the tables on the dense kernel: each table's rows (two shards) and its
    Adam moments come back whole on the one rank, and training continues."""
    out, ranks = plain
    proc = subprocess.run(
        [sys.executable, str(WORKER), "reshard", str(out / "dense_kernel" / "checkpoints" / "step_15"), str(tmp_path)]
        + ["dense"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=worker_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "reshard.json").read_text())
    tables = ranks[0]["dense_kernel"]["tables"]  # global sizes, as the checkpoint holds them
    assert report["moments"] and len(report["moments"]) == len(tables)
    for name, (shape, magnitude) in report["moments"].items():
        assert shape in tables.values(), name  # the whole table on this rank
        assert magnitude > 0, name  # restored from the checkpoint, not fresh zeros
    assert report["start"][0] == 15 and report["end_step"] == 20
    assert all(0 < loss < 10 for loss in report["losses"])


# -- the CLI: SIGKILL between checkpoints, SIGTERM, two torchrun agents -------------------------


def _torchrun(
    *args: str, nproc: int = 2, env: dict | None = None, cwd: Path, restarts: int = 0
) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    command += [f"--max-restarts={restarts}"] if restarts else []
    return subprocess.run(
        [*command, "--no-python", str(BIN / "recsys-train"), *CONFIG, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=cwd,
        env=worker_env(**(env or {})),
    )


def _ranks(*args: str, env: dict | None = None, cwd: Path) -> subprocess.CompletedProcess:
    """`recsys-train` on 2 ranks, the ranks forked (`fork_ranks`): for the runs that are not about
    torchrun (references, resumes); the killed and preempted runs go through torchrun."""
    return fork_ranks(BIN / "recsys-train", *CONFIG, *args, timeout=TIMEOUT, env=env, cwd=cwd)


def _run_dir(output_dir: Path) -> Path:
    (path,) = (output_dir / "recsys-train").iterdir()
    return path


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _flat(node, prefix=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _flat(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


def _checkpoint(path: Path, tmp: Path) -> dict:
    """Everything in a checkpoint, tables gathered whole (read without a process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp / f"{path.parent.parent.name}_{path.name}.pt"
    dcp_to_torch_save(path, target)
    state = dict(_flat(torch.load(target, weights_only=False)))
    for rng in sorted((path / "rng").iterdir()):
        state |= {f"{rng.stem}.{k}": v for k, v in _flat(torch.load(rng, weights_only=True))}
    return state


def _assert_same_checkpoint(a: Path, b: Path, tmp: Path) -> None:
    left, right = _checkpoint(a, tmp), _checkpoint(b, tmp)
    assert left.keys() == right.keys()
    assert any(".ec." in k for k in left) and any(".momentum1" in k for k in left)  # tables and their state
    assert any("rank1.torch" in k for k in left)  # every rank's RNG
    for key, value in left.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, right[key]), key
        else:
            assert value == right[key], key


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 30-step run on 2 ranks (checkpoints at 10, 20, 30)."""
    out = tmp_path_factory.mktemp("reference")
    proc = _ranks("pipeline=serial", f"trainer.output_dir={out}", cwd=out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _run_dir(out)


#: 2-micro-step gradient accumulation (a checkpoint every 10 steps ends a window)
ACCUMULATE = ("trainer.grad_accumulation.steps=2",)


@pytest.fixture(scope="module")
def accumulated_reference(tmp_path_factory):
    """The uninterrupted run of `reference` with gradient accumulation, on the hstu_prefetch plan."""
    out = tmp_path_factory.mktemp("accumulated_reference")
    proc = _ranks("pipeline=hstu_prefetch", *ACCUMULATE, f"trainer.output_dir={out}", cwd=out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _run_dir(out)


# The plan with the most lookahead with gradient accumulation, killed at step 17 (inside a window): what
# is lost is the window and the steps since step_10. The in-process resume above covers every
# plan, and the self-healing test below kills hstu_prefetch without accumulation.
def test_sigkill_between_checkpoints_then_resume_is_bitwise(accumulated_reference, tmp_path):
    plan, extra, reference = "hstu_prefetch", ACCUMULATE, accumulated_reference
    killed = _torchrun(
        f"pipeline={plan}",
        *extra,
        FAULT_OVERRIDE,
        f"trainer.output_dir={tmp_path}/a",
        env={FAULT_ENV: "sigkill:0:17"},
        cwd=tmp_path,
    )
    assert killed.returncode != 0 and "Signal 9 (SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    crashed = _run_dir(tmp_path / "a")
    assert sorted(p.name for p in (crashed / "checkpoints").iterdir()) == ["step_10"]  # 20 was never reached
    resumed = _ranks(
        f"pipeline={plan}",
        *extra,
        f"trainer.output_dir={tmp_path}/b",
        f"trainer.resume_from={crashed}",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    run_dir = _run_dir(tmp_path / "b")
    losses, ref = _losses(run_dir), _losses(reference)
    assert sorted(losses) == list(range(11, 31))
    assert losses == {step: ref[step] for step in losses}
    _assert_same_checkpoint(run_dir / "checkpoints" / "step_30", reference / "checkpoints" / "step_30", tmp_path)


def test_sigterm_on_one_rank_checkpoints_every_rank_at_the_same_step(reference, tmp_path):
    """Only rank 1 gets SIGTERM (at the start of step 7): both ranks stop after step 8 (the agreement is
    one step late), save step_8, exit 75; resuming it continues bitwise."""
    preempted = _torchrun(
        "pipeline=hstu_prefetch",
        "thread_map=per_task",
        "trainer.preemption_check_s=0",  # agree every step: the stop step is known exactly
        FAULT_OVERRIDE,
        f"trainer.output_dir={tmp_path}/a",
        env={FAULT_ENV: "sigterm:1:7"},
        cwd=tmp_path,
    )
    assert preempted.returncode != 0
    assert preempted.stderr.count("exitcode  : 75") == 2, preempted.stderr[-3000:]
    assert "SIGTERM received: stopped after step 8 on every rank" in preempted.stderr
    run_dir = _run_dir(tmp_path / "a")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_8"]
    assert max(_losses(run_dir)) == 8
    # what a requeued job runs: the same command plus resume_from=latest (newest under output_dir)
    resumed = _ranks(
        "pipeline=hstu_prefetch", f"trainer.output_dir={tmp_path}/a", "trainer.resume_from=latest", cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    (new_dir,) = [p for p in (tmp_path / "a" / "recsys-train").iterdir() if p != run_dir]
    losses, ref = _losses(new_dir), _losses(reference)
    assert sorted(losses) == list(range(9, 31)) and losses == {step: ref[step] for step in losses}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_train_like_one_agent_with_two_processes(reference, tmp_path):
    """`--nnodes 2` on one machine (c10d rendezvous on 127.0.0.1): one run directory, the same
    per-step losses and final checkpoint as one agent with 2 processes."""
    port = _free_port()
    env = worker_env()
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "1",
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                f"127.0.0.1:{port}",
                "--rdzv_id",
                "multinode-test",
                "--no-python",
                str(BIN / "recsys-train"),
                *CONFIG,
                "pipeline=serial",
                f"trainer.output_dir={tmp_path}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=env,
            start_new_session=True,
        )
        for node in range(2)
    ]
    try:
        outputs = [agent.communicate(timeout=TIMEOUT) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    for agent, (_, err) in zip(agents, outputs):
        assert agent.returncode == 0, err[-4000:]
    run_dir = _run_dir(tmp_path)  # exactly one run directory
    assert "2 rank(s)" in (run_dir / "train.log").read_text()
    assert _losses(run_dir) == _losses(reference)
    _assert_same_checkpoint(run_dir / "checkpoints" / "step_30", reference / "checkpoints" / "step_30", tmp_path)


# -- gradient accumulation: resume after a checkpoint and after SIGTERM inside a window ----------


@pytest.fixture(scope="module")
def accumulation(tmp_path_factory):
    """tests/dist/resume_worker.py `accumulation` on 2 ranks and on 1 rank, each with serial,
    sparse_dist and hstu_prefetch: {world size: [per-rank results]}."""
    runs = {}
    plans = ["serial", "sparse_dist", "hstu_prefetch"]
    for nproc in (2, 1):
        out = tmp_path_factory.mktemp(f"accumulation{nproc}")
        check_torchrun(fork_ranks(WORKER, "accumulation", str(out), *plans, nproc=nproc, timeout=TIMEOUT))
        runs[nproc] = [json.loads((out / f"accumulation_rank{r}.json").read_text()) for r in range(nproc)]
    return runs


def test_accumulation_resumes_bitwise_from_a_checkpoint(accumulation):
    """Resuming at a window boundary (step 8 of 4-micro-step windows) starts on a micro-step that
    runs under no_sync: the run continues (no DDP reducer assertion) and bitwise."""
    for nproc, ranks in accumulation.items():
        for data in ranks:
            assert len(data) == 3
            for plan, got in data.items():
                assert len(got["ref_losses"]) == 24
                assert got["resumed_at"] == 8, (nproc, plan)
                assert got["resumed_losses"] == got["ref_losses"][8:], (nproc, plan)
                assert got["resumed_params"] == got["ref_params"], (nproc, plan)


def test_sigterm_inside_an_accumulation_window_finishes_the_window_then_resumes_bitwise(accumulation):
    """SIGTERM reaches the last rank at step 13, inside the window of steps 13..16: every rank
    trains on to step 16 (the window's optimizer step), checkpoints there and stops; resuming
    that checkpoint loses nothing."""
    for nproc, ranks in accumulation.items():
        for data in ranks:
            for plan, got in data.items():
                assert got["stopped"] == ["preempted", 16, "step_16"], (nproc, plan)
                assert got["stopped_losses"] == got["ref_losses"][:16], (nproc, plan)
                assert got["after_at"] == 16
                assert got["after_losses"] == got["ref_losses"][16:], (nproc, plan)
                assert got["after_params"] == got["ref_params"], (nproc, plan)


# -- semi-synchronous plans: the lookup in flight and the kept gradients -----------------------


@pytest.fixture(scope="module")
def semi_sync(tmp_path_factory):
    """tests/dist/resume_worker.py `semi_sync` on 2 ranks (semi_sync, semi_sync_stash, and
    semi_sync on the threaded executor with a thread per task; warm-up of batches 0..2):
    per-rank results and the launch's output."""
    out = tmp_path_factory.mktemp("semi_sync")
    plans = ["semi_sync", "semi_sync_stash", "semi_sync/threaded"]
    proc = fork_ranks(WORKER, "semi_sync", str(out), *plans, timeout=TIMEOUT)
    check_torchrun(proc)
    return [json.loads((out / f"semi_sync_rank{r}.json").read_text()) for r in range(2)], proc.stdout + proc.stderr


def test_semi_sync_plans_resume_bitwise_inside_and_after_the_warm_up(semi_sync):
    """The checkpoint holds the lookup of the next step (started before the last update, so the
    tables it holds cannot give it again) and semi_sync_stash's kept gradients: a resume from
    step 2 (inside the warm-up; the resumed run crosses into the stale steps) and from step 4
    (after it; warming up again would train steps 4..6 on fresh embeddings) is bitwise, also
    with a thread per task."""
    ranks, _ = semi_sync
    for data in ranks:
        assert set(data) == {"semi_sync", "semi_sync_stash", "semi_sync/threaded"}
        for plan, got in data.items():
            assert len(got["ref_losses"]) == 10
            for step in ("2", "4"):
                resumed = got["resumes"][step]
                assert resumed["at"] == int(step), (plan, step)
                assert resumed["losses"] == got["ref_losses"][int(step) :], (plan, step)
                assert resumed["params"] == got["ref_params"], (plan, step)
                assert got["in_flight"][step]["lookup_steps"] == [int(step)], (plan, step)
        # the stash starts at batch 2: the step-4 checkpoint keeps batch 3's gradients
        assert data["semi_sync"]["in_flight"]["4"]["stashed"] == 0
        assert data["semi_sync_stash"]["in_flight"]["2"]["stashed"] == 0
        assert data["semi_sync_stash"]["in_flight"]["4"]["stashed"] > 0
        assert data["semi_sync"]["ref_losses"] != data["semi_sync_stash"]["ref_losses"]
        assert data["semi_sync/threaded"]["ref_losses"] == data["semi_sync"]["ref_losses"]


def test_semi_sync_resume_without_what_was_in_flight_is_not_bitwise(semi_sync):
    """Controls: resumed from the step-4 checkpoint without the saved lookup, semi_sync's step 5
    already differs; without the kept gradients, semi_sync_stash's step 5 has the same loss (its
    forward comes before the optimizer step that applies them) and the later steps differ. So
    each is what keeps the resumes above bitwise; only the resume without a lookup warns."""
    ranks, output = semi_sync
    for data in ranks:
        lookup, stash = data["semi_sync"], data["semi_sync_stash"]
        assert len(lookup["control_losses"]) == len(stash["control_losses"]) == 6
        assert lookup["control_losses"][0] != lookup["ref_losses"][4]
        assert stash["control_losses"][0] == stash["ref_losses"][4]
        assert stash["control_losses"][1] != stash["ref_losses"][5]
    warnings = [line for line in output.splitlines() if "holds no lookup in flight" in line]
    assert len(warnings) == 1 and "(semi_sync)" in warnings[0], warnings


# -- self-healing: torchrun restarts the job after a rank dies, and it resumes by itself ---------


def test_a_rank_killed_under_torchrun_restarts_costs_nothing_but_time(reference, tmp_path):
    """`torchrun --max-restarts=1 ... trainer.resume_from=latest`: rank 1 is SIGKILLed at step 17 of
    the first attempt; torchrun restarts both ranks, which resume from step_10 and finish with
    exit 0 and the per-step losses and final checkpoint of an uninterrupted run."""
    healed = _torchrun(
        "pipeline=hstu_prefetch",
        FAULT_OVERRIDE,
        f"trainer.output_dir={tmp_path}",
        "trainer.resume_from=latest",
        env={FAULT_ENV: "sigkill:1:17"},
        cwd=tmp_path,
        restarts=1,
    )
    assert healed.returncode == 0, healed.stderr[-4000:]
    first, second = sorted((tmp_path / "recsys-train").iterdir())  # one run directory per attempt
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step_10"]
    ref, before, after = _losses(reference), _losses(first), _losses(second)
    assert 10 <= max(before) < 17  # the first attempt died in step 17
    assert sorted(after) == list(range(11, 31)) and after == {step: ref[step] for step in after}
    assert before and before == {step: ref[step] for step in before}
    _assert_same_checkpoint(second / "checkpoints" / "step_30", reference / "checkpoints" / "step_30", tmp_path)
