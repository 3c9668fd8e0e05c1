"""The memory estimate before the start (`recsys_pipe.train.memory`): its parts against what the
plan places on each rank, the one line `recsys-plan ... memory_gib=` and `recsys-train --check`
print, the fake-process-group dry run, and the bad topologies refused before any process group
(exit 2, one line). The estimate against measured peak RSS on 1-8 ranks is the scenario's
(`recsys-bench multi_host`), too slow for the suite."""

from __future__ import annotations

import re

import pytest

from recsys_pipe.cli import plan as plan_cli
from recsys_pipe.cli import train as train_cli
from recsys_pipe.testing import load_run
from recsys_pipe.train.memory import GIB, estimate_memory, probe_activations
from recsys_pipe.train.parallel import Topology
from recsys_pipe.train.plan import training_plan

pytestmark = pytest.mark.timeout(300)

DLRM = ["model=dlrm", "data.num_embeddings=1000", "pipeline=serial", "trainer.device=cpu"]


def _estimate(*overrides: str, ranks: int = 4, local: int = 2, device: str = "cpu", gib: float | None = None):
    run = load_run(*DLRM, *overrides)
    return run, estimate_memory(run, training_plan(run), Topology(ranks, local, device), gib)


def test_the_table_part_is_what_the_plan_places_on_each_rank():
    """26 tables of 1000 x 16, table-wise over 4 ranks: ranks 0 and 1 hold 7 tables, 2 and 3 hold 6."""
    run, est = _estimate("model.sharding=table_wise")
    held = [7, 7, 6, 6]
    assert [r.parts["tables fused"] for r in est.ranks] == [n * 1000 * 16 * 4 for n in held]
    assert [r.parts["rowwise_adagrad state (fused)"] for r in est.ranks] == [n * 1000 * 4 for n in held]
    _, adagrad = _estimate("model.sharding=table_wise", "optimizer.sparse.name=adagrad")
    assert adagrad.ranks[0].parts["adagrad state (fused)"] == 7 * 1000 * 16 * 4  # one per entry
    _, dense = _estimate("model.sharding=row_wise", "model.compute_kernel=dense", "optimizer=adam")
    assert dense.ranks[3].parts["adam state+grads (dense)"] == 26 * 250 * 16 * (4 + 2 * 4)  # gradient + 2 moments
    params = sum(p.numel() for n, p in run.model.build(run.data.spec()).named_parameters() if "embedding" not in n)
    assert est.ranks[0].parts["dense"] == params * 4 * (2 + 2)  # weights, gradients, Adam's two moments
    assert est.ranks[0].parts["build"] == 26 * 1000 * 16 * 4  # the unsharded tables, while building (CPU)
    assert est.ranks[0].phase == "build"


def test_per_shard_tables_drop_the_build_part_and_a_build_bound_job_is_told_so(monkeypatch):
    """model.table_init=per_shard: no rank builds the unsharded tables. Where only the build part
    keeps a rank from fitting, the estimate's note and `recsys-train --check`'s warning say so."""
    from recsys_pipe.train.memory import check_memory

    run, unsharded = _estimate("model.sharding=row_wise")
    _, per_shard = _estimate("model.sharding=row_wise", "model.table_init=per_shard")
    assert "build" in unsharded.columns and "build" not in per_shard.columns
    assert all(r.phase == "training" for r in per_shard.ranks)
    assert [r.parts for r in per_shard.ranks] == [
        {k: v for k, v in r.parts.items() if k != "build"} for r in unsharded.ranks
    ]
    between = (unsharded.largest.peak + per_shard.largest.peak) / 2 / GIB
    _, tight = _estimate("model.sharding=row_wise", gib=between)
    assert not tight.fits() and tight.build_bound()
    assert any(n.startswith("model.table_init=per_shard would fit, rank ") for n in tight.notes)
    assert _estimate("model.sharding=row_wise", "model.table_init=per_shard", gib=between)[1].fits()
    _, short = _estimate("model.sharding=row_wise", gib=per_shard.largest.peak / 2 / GIB)
    assert not short.build_bound() and not any("per_shard" in n for n in short.notes)  # not enough either way
    _, cuda = _estimate("model.sharding=row_wise", "model.table_init=per_shard", device="cuda")
    assert not any(n.startswith("host memory while building") for n in cuda.notes)

    import recsys_pipe.train.memory as memory

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(memory, "device_capacity", lambda device, local: int(between * GIB))
    _, warning = check_memory(run, training_plan(run), "cpu")
    assert warning is not None and "model.table_init=per_shard would fit" in warning


def test_activations_are_measured_per_sample():
    small, large = (probe_activations(load_run(*DLRM, f"data.batch_size={b}")) for b in (16, 64))
    assert small.batch_size == 16 and large.batch_size == 64
    assert 1000 < large.per_sample < 100_000 and abs(large.per_sample / small.per_sample - 1) < 0.25
    assert large.ids_per_sample == {f"cat_{i}": 1.0 for i in range(26)}  # one id per feature and row


def test_the_verdict_says_which_rank_and_whether_it_fits():
    _, est = _estimate("model.sharding=table_wise", device="cuda", gib=80)
    assert "build" not in est.columns  # the host's memory on CUDA: a note
    assert any(n.startswith("host memory while building") for n in est.notes)
    assert est.fits() and re.fullmatch(
        r"estimated peak memory: largest rank 0, \d+\.\d\d GiB of 80\.00 GiB per rank: fits", est.verdict()
    )
    _, tight = _estimate("model.sharding=table_wise", device="cuda", gib=0.5)
    assert not tight.fits() and tight.verdict().endswith("of 0.50 GiB per rank: does NOT fit")
    assert tight.largest.peak > 0.5 * GIB


def test_recsys_plan_prints_the_table_and_the_dry_run(tmp_path, capsys):
    code = plan_cli.run(
        [
            *DLRM,
            "model.sharding=table_row_wise",
            "world_size=8",
            "local_world_size=4",
            "device=cuda",
            "memory_gib=80",
            "dry_run=true",
            "dry_run_rank=5",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "memory per rank (dlrm; 8 rank(s), 2 host(s) x 4, cuda), MiB:" in out
    rows = re.findall(r"^\s+(\d+)\s+[\d.]+\s", out, re.M)
    assert rows == [str(r) for r in range(8)]
    assert re.search(r"^estimated peak memory: largest rank \d, 1\.\d\d GiB of 80\.00 GiB per rank: fits$", out, re.M)
    (dry,) = [line for line in out.splitlines() if line.startswith("dry run: rank 5's tables")]
    assert "fake process group of 8 ranks (2 host(s) x 4)" in dry and dry.endswith("(+0.0%)")
    assert (tmp_path / "model.txt").read_text().count("estimated peak memory") == 1


def test_a_dry_run_of_sequence_tables_beyond_one_rank_is_refused_in_one_line(tmp_path, capsys):
    """HSTU's EmbeddingCollection gathers shard metadata the fake process group does not carry:
    refused naming dry_run; at one rank it builds."""
    args = ["model.sharding=row_wise", "local_world_size=2", "dry_run=true", f"hydra.run.dir={tmp_path}"]
    assert plan_cli.run([*args, "world_size=2"]) == 2
    captured = capsys.readouterr()
    (error,) = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert error.startswith("error: dry_run: the dry run cannot build sequence tables (torchrec's EmbeddingCollection")
    assert plan_cli.run(["model.sharding=row_wise", "dry_run=true", f"hydra.run.dir={tmp_path}"]) == 0
    assert "dry run: rank 0's tables built under a fake process group of 1 ranks" in capsys.readouterr().out


def test_recsys_train_check_prints_the_line_and_warns(monkeypatch, capsys, no_process_group):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "3")
    assert train_cli.run([*DLRM, "model.sharding=row_wise", "trainer=smoke", "--check"]) == 0
    captured = capsys.readouterr()
    assert re.search(
        r"^estimated peak memory: largest rank \d, [\d.]+ GiB of [\d.]+ GiB per rank: fits$", captured.out, re.M
    )
    import recsys_pipe.train.memory as memory

    monkeypatch.setattr(memory, "device_capacity", lambda device, local: 100 * 2**20)  # a rank with 100 MiB
    assert train_cli.run([*DLRM, "model.sharding=row_wise", "trainer=smoke", "--check"]) == 0  # a warning only
    captured = capsys.readouterr()
    assert "GiB of 0.10 GiB per rank: does NOT fit" in captured.out
    (warning,) = [line for line in captured.err.splitlines() if line.startswith("warning: ")]
    assert re.match(
        r"warning: rank \d needs an estimated [\d.]+ GiB, more than the 0.10 GiB one rank has here", warning
    )


@pytest.mark.parametrize(
    "env, overrides, line",
    [
        (
            {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
            ["model=hstu_small", "model.sharding=table_row_wise"],
            "error: model.sharding: table_row_wise is not offered for table 'item_table' (module 'ec', "
            "EmbeddingCollection) by EmbeddingCollectionSharder on cpu",
        ),
        (
            {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
            [*DLRM, "model.sharding=table_row_wise"],
            "error: model.sharding: table_row_wise splits each table over the ranks of one host and needs 2 or more "
            "hosts",
        ),
        (
            {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3"},
            DLRM,
            "error: LOCAL_WORLD_SIZE: 3 ranks per host do not divide the 4 ranks",
        ),
    ],
)
def test_bad_topologies_exit_2_in_one_line_before_any_process_group(
    env, overrides, line, monkeypatch, capsys, no_process_group
):
    for key, value in {**env, "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    assert train_cli.run([*overrides, "trainer=smoke", "--check"]) == 2
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(line), err
    assert "Traceback" not in err


def test_recsys_plan_refuses_ranks_per_host_that_do_not_divide(tmp_path, capsys):
    assert plan_cli.run([*DLRM, "world_size=8", "local_world_size=3", f"hydra.run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: local_world_size: 3 ranks per host do not divide the 8 ranks"), err
