"""`parallel.pp`: every constraint exits 2 with one line naming its key, before any process
group starts; the layer split."""

from __future__ import annotations

import pytest

from recsys_pipe.cli import train as train_cli
from recsys_pipe.config import ConfigError
from recsys_pipe.pp import PipelineParallelConfig, split_layers
from recsys_pipe.pp_schedules.actions import PipelineSchedule, to_csv
from recsys_pipe.pp_schedules.generators import build

# (WORLD_SIZE, overrides, the key the first error names, a fragment of its message)
CASES = [
    (2, ["parallel.pp.size=2", "parallel.pp.microbatches=1"], "parallel.pp.microbatches", "cannot fill 2 stages"),
    (1, ["parallel.pp.size=2"], "parallel.pp.size", "2 pipeline ranks do not divide the world of 1 rank(s)"),
    (2, ["parallel.pp.schedule=dualpipe"], "parallel.pp.schedule", "unknown schedule 'dualpipe'"),
    (2, ["parallel.pp.size=2", "parallel.pp.layers=[1,1,1]"], "parallel.pp.layers", "the schedule has 2"),
    (2, ["parallel.pp.size=2", "parallel.pp.layers=[1,2]"], "parallel.pp.layers", "model.num_layers=2"),
    (4, ["parallel.pp.size=4"], "parallel.pp.size", "4 stages need at least 4 layers, model.num_layers=2"),
    (2, ["parallel.pp.size=2", "model=dlrm"], "parallel.pp.size", "model 'dlrm' cannot be split into stages"),
    (2, ["parallel.pp.size=2", "parallel.pp.microbatches=3"], "parallel.pp.microbatches", "data.batch_size=32"),
    (2, ["parallel.pp.size=2", "trainer.precision=bf16"], "trainer.precision", "fp32 with parallel.pp"),
    (2, ["parallel.pp.size=2", "trainer.compile=true"], "trainer.compile", "not with parallel.pp yet"),
    (2, ["parallel.pp.size=2", "model.sharding=planner"], "model.sharding", "torchrec's dense kernel"),
    (
        2,
        ["parallel.pp.size=2", "optimizer.clip_grad_norm=1"],
        "optimizer.clip_grad_norm",
        "clipping over pipeline stages",
    ),
]


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


def test_a_sweep_checks_each_jobs_stages_as_the_job_would(tmp_path, capsys, monkeypatch, no_process_group):
    """Job 1's stages do not fit the world of 1 rank: found for every job before the first starts."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    sweep = tmp_path / "sweep"
    code = train_cli.run(["-m", "parallel.pp.size=1,2", f"hydra.sweep.dir={sweep}", f"trainer.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert lines == [
        "error: parallel.pp.size: 2 pipeline ranks do not divide the world of 1 rank(s) "
        "[sweep job 1: parallel.pp.size=2]"
    ], err
    assert not sweep.exists()


@pytest.mark.parametrize(
    ("world", "overrides"),
    [
        (1, ["parallel.pp.microbatches=1"]),  # no pipeline (the default)
        (2, ["parallel.pp.size=2", "parallel.pp.schedule=zb_h1"]),  # the main job's model, evaluation included
        # the tables train on the dense kernel under parallel.pp: no fused optimizer to check on the CPU
        (2, ["parallel.pp.size=2", "optimizer.sparse.name=adam", "model.sharding=row_wise"]),
    ],
)
def test_a_config_that_fits_passes_every_check(world, overrides, tmp_path, monkeypatch, no_process_group):
    """`--check` exits 0, starting nothing."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    code = train_cli.run(["--check", *overrides, f"hydra.run.dir={tmp_path}", f"trainer.output_dir={tmp_path}/runs"])
    assert code == 0


def test_layers_split_evenly_first_stages_larger_or_as_listed():
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert split_layers(4, 3, [1, 2, 1]) == [range(0, 1), range(1, 3), range(3, 4)]
    with pytest.raises(ValueError, match="cannot split 4 layers into 2 stages"):
        split_layers(4, 2, [1, 2])


def _problem(**fields):
    with pytest.raises(ConfigError) as info:
        PipelineParallelConfig(**fields)
    (problem,) = info.value.problems
    return problem.path, problem.message


def test_named_schedules_resolve_to_plans_or_torchs_action_orders():
    plan = PipelineParallelConfig(size=2, schedule="zb_h1").resolved()
    assert plan.lookaheads and plan.ranks_of_stages == (0, 1) and plan.microbatches == 2
    assert plan.actions.ranks[0] == PipelineSchedule.of([["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"]]).ranks[0]
    interleaved = PipelineParallelConfig(size=2, microbatches=4, schedule="interleaved_1f1b").resolved()
    assert interleaved.ranks_of_stages == (0, 1, 0, 1) and interleaved.local_stages(1) == (1, 3)
    v = PipelineParallelConfig(size=2, microbatches=4, schedule="dualpipev").resolved()
    assert v.ranks_of_stages == (0, 1, 1, 0)
    assert {a.kind for row in v.actions.ranks for a in row} >= {"F", "B", "W"}


@pytest.mark.parametrize(
    ("fields", "path", "fragment"),
    [
        (
            {"size": 2, "microbatches": 2, "schedule": "dualpipev"},
            "parallel.pp.microbatches",
            "dualpipev needs m >= 2p",
        ),
        ({"size": 2, "microbatches": 4, "schedule": "zbv", "stages_per_rank": 3}, "parallel.pp.stages_per_rank", "V"),
        ({"size": 2, "schedule": "1f1b", "stages_per_rank": 2}, "parallel.pp.stages_per_rank", "one stage per rank"),
        ({"size": 2, "microbatches": 4, "schedule": "interleaved_1f1b", "layers": [1, 1]}, "parallel.pp.layers", "4"),
        ({"size": 2, "schedule": "/nonexistent/s.csv"}, "parallel.pp.schedule", "no such file"),
    ],
)
def test_schedule_misfits_name_their_key(fields, path, fragment):
    got_path, message = _problem(**fields)
    assert got_path == path and fragment in message, message


def test_a_csv_schedule_is_checked_against_the_config(tmp_path):
    csv = tmp_path / "zb.csv"
    to_csv(build("zb_h1", 2, 4), csv)
    resolved = PipelineParallelConfig(size=2, microbatches=4, schedule=str(csv)).resolved()
    assert resolved.ranks_of_stages == (0, 1) and resolved.actions is not None
    assert "has 2 rank row(s), parallel.pp.size=4" in _problem(size=4, microbatches=4, schedule=str(csv))[1]
    assert "runs 4 microbatch(es), parallel.pp.microbatches=8" in _problem(size=2, microbatches=8, schedule=str(csv))[1]
    assert "not 2 on each" in _problem(size=2, microbatches=4, schedule=str(csv), stages_per_rank=2)[1]
    broken = tmp_path / "broken.csv"
    broken.write_text("0F0,0W0,0I0\n1F0,1I0,1W0\n")  # W before its B on rank 0
    path, message = _problem(size=2, microbatches=2, schedule=str(broken))
    assert path == "parallel.pp.schedule" and "broken.csv" in message and "0W0 comes before 0I0" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["parallel.pp.schedule=zb_h1", "parallel.pp.microbatches=4"],
            [
                "rank 0 (stage 0):",
                "  tasks@lookahead: F@1, send_F@1, recv_B@0, B@0, W@0  (ring: 2 microbatch(es) in flight)",
                "  order: 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3",
                "rank 1 (stage 1):",
                "  order: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3",
                "simulated with T_F = T_B = T_W = 1: makespan 13, bubble 1, peak activations per rank [2, 1]",
            ],
        ),
        (
            ["parallel.pp.schedule=dualpipev", "parallel.pp.microbatches=4", "model.num_layers=4", "world_size=4"],
            [
                "rank 0 (stages 0, 3):",
                "rank 1 (stages 1, 2):",
                "each rank runs its action list in order",
                # 2 x 2 ranks: the tables shard over the first stage's 2 replicas, on the dense kernel
                "model: hstu (torchrec tables, model.sharding=table_wise; sharding plan for 2 rank(s) (the first "
                "stage's replicas)",
                "item_table   | table_wise    | dense          | [0]",
            ],
        ),
    ],
)
def test_recsys_plan_shows_each_ranks_pipeline(overrides, expected, tmp_path, capsys):
    from recsys_pipe.cli import plan as plan_cli

    code = plan_cli.run(["parallel.pp.size=2", *overrides, f"hydra.run.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    for line in expected:
        assert any(got.startswith(line) for got in lines), f"{line!r} not in:\n{out}"
    assert "rank 1 (stage" in (tmp_path / "plan.txt").read_text()
