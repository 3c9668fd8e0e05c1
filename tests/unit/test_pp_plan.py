"""Pipeline-parallel schedules become per-rank action lists, which one runner runs.

No processes. Lookahead schedules (GPipe, 1F1B, ZB-H1, ZB-H2, or a YAML file) compile to the
order the engine fires a plan of those lookaheads in (`lookahead_order`); a rank's action list
becomes its engine plan, transfers included (`action_schedule`).
"""

import pytest

from recsys_pipe.engine import PlanRunner, Task, TaskGraph
from recsys_pipe.pp.actions import action_schedule, stage_ranks
from recsys_pipe.pp.schedules import resolve_schedule
from recsys_pipe.pp_schedules.actions import PipelineSchedule
from recsys_pipe.pp_schedules.generators import build
from recsys_pipe.pp_schedules.lookahead import lookahead_order, stage_plan, task_lookaheads


def engine_order(plan):
    """(kind, microbatch) in the order the engine fires the plan's compute tasks at their
    lookaheads over one step's microbatches (slots F -> B -> W, as a stage's tasks hand over)."""
    log = []

    def record(kind):
        return lambda ctx: log.append((kind, ctx.batch_index))

    computes = [(kind, k) for kind, k in task_lookaheads(plan) if kind in ("F", "B", "BW", "W")]
    slots = {"F": ([], ["fwd"]), "B": (["fwd"], ["bwd"]), "BW": (["fwd"], ["bwd"]), "W": (["bwd"], [])}
    tasks = [
        Task.from_fn(kind, record(kind), lookahead=k, reads=slots[kind][0], writes=slots[kind][1])
        for kind, k in computes
    ]
    with PlanRunner(TaskGraph.single_group(tasks)) as pipeline:
        for _ in pipeline.iterate(iter(range(plan.microbatches))):
            pass
    return log


CASES = [
    (name, p, m) for name in ("gpipe", "1f1b", "zb_h1", "zb_h2") for p in (1, 2, 4) for m in (1, 3, 4, 8) if m >= p
]


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_a_lookahead_schedule_compiles_to_the_order_the_engine_fires_it_in(name, p, m):
    """The lookaheads mean what they mean to the engine: the compiled order is the firing order."""
    for r in range(p):
        plan = stage_plan(name, p, r, m)
        assert [(a.kind, a.microbatch) for a in lookahead_order(plan)] == engine_order(plan), f"rank {r}"


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8)])
def test_gpipe_runs_every_forward_before_any_backward(p, m):
    for r in range(p):
        order = [(a.kind, a.microbatch) for a in build("gpipe", p, m).ranks[r]]
        assert order == [("F", j) for j in range(m)] + [("BW", j) for j in range(m)]


def test_1f1b_warms_up_then_alternates():
    """Rank r runs p-1-r forwards, then one forward and one full backward in turn, then the rest."""
    p, m = 4, 8
    for r in range(p):
        warmup = p - 1 - r
        expected = [("F", j) for j in range(warmup)]
        for k in range(m - warmup):
            expected += [("F", warmup + k), ("BW", k)]
        expected += [("BW", k) for k in range(m - warmup, m)]
        assert [(a.kind, a.microbatch) for a in build("1f1b", p, m).ranks[r]] == expected


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "zb_h2", "gpipe"])
def test_transfers_wrap_their_compute(name):
    """A rank's plan receives right before each compute step and sends right after it; none at
    the pipeline's ends."""
    p, m = 4, 8
    resolved = resolve_schedule(name, p, m, None)
    for r in range(p):
        log = [t.name for t in action_schedule(resolved.actions, r, resolved.ranks_of_stages, m).tasks]
        for i, task in enumerate(log):
            if task.startswith(f"{r}F"):
                mb = task[len(f"{r}F") :]
                assert (log[i - 1] == f"{r}RECV_F{mb}") == (r > 0)
                assert (log[i + 1] == f"{r}SEND_F{mb}") == (r < p - 1)
            if task.startswith((f"{r}I", f"{r}B")):
                mb = task[len(f"{r}I") :]
                assert (log[i - 1] == f"{r}RECV_B{mb}") == (r < p - 1)
                assert (log[i + 1] == f"{r}SEND_B{mb}") == (r > 0)
        assert sum("SEND_F" in t for t in log) == (m if r < p - 1 else 0)
        assert sum("SEND_B" in t for t in log) == (m if r > 0 else 0)


def test_ring_depth_is_the_activation_memory():
    """F's lookahead + 1 microbatches are in flight: 1F1B's p - r on rank r, ZB-H2's 2p - 1."""
    p, m = 4, 8
    assert [stage_plan("1f1b", p, r, m).ring_slots for r in range(p)] == [4, 3, 2, 1]
    assert [stage_plan("zb_h2", p, r, m).ring_slots for r in range(p)] == [7] * 4
    assert stage_plan("gpipe", p, 0, m).ring_slots == m


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown single-stage pipeline schedule 'dualpipe'"):
        stage_plan("dualpipe", 2, 0, 4)


# -- the static action-order mode (several stages per rank, CSVs) ---------------------------------


def test_stage_layouts():
    assert stage_ranks(2, 2, "loop") == (0, 1, 0, 1)
    assert stage_ranks(2, 2, "v") == (0, 1, 1, 0)
    assert stage_ranks(4, 2, "v") == (0, 1, 2, 3, 3, 2, 1, 0)
    with pytest.raises(ValueError, match="2 stages per rank"):
        stage_ranks(2, 3, "v")


def test_actions_become_tasks_in_order_with_transfers_only_between_ranks():
    """V layout on 2 ranks: rank 1 holds stages 1 and 2, which hand over to each other locally."""
    schedule = PipelineSchedule.of(
        [["0F0", "3F0", "3I0", "3W0", "0I0", "0W0"], ["1F0", "2F0", "2I0", "1I0", "2W0", "1W0"]]
    )
    rank1 = [t.name for t in action_schedule(schedule, 1, stage_ranks(2, 2, "v"), 1).tasks]
    assert rank1 == ["1RECV_F0", "1F0", "2F0", "2SEND_F0", "2RECV_B0", "2I0", "1I0", "1SEND_B0", "2W0", "1W0", "losses"]
    rank0 = [t.name for t in action_schedule(schedule, 0, stage_ranks(2, 2, "v"), 1).tasks]
    assert rank0 == ["0F0", "0SEND_F0", "3RECV_F0", "3F0", "3I0", "3SEND_B0", "3W0", "0RECV_B0", "0I0", "0W0", "losses"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (["0F0", "1F0"], r"action 1F0 does not fit \(stage 1 is on rank 1"),
        (["0F0", "0F5"], "microbatches 0..1"),
        (["0I0", "0F0"], r"action 0I0 runs before what it needs \(0F0\)"),
        (["0F0", "0W0"], "the action list does not fit"),  # W without its B
    ],
)
def test_an_action_list_that_does_not_fit_is_refused(row, message):
    schedule = PipelineSchedule.of([row, []])
    with pytest.raises(ValueError, match=message):
        action_schedule(schedule, 0, (0, 1), 2)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_our_dualpipev_is_torchs_dualpipev_order(p):
    """build("dualpipev") generates the V form torch's ScheduleDualPipeV runs, action for action
    (overlapped F&B pairs included), and it passes validation (no deadlock)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from recsys_pipe.autosched.pipeline_parallel import validate

    for m in (2 * p, 2 * p + 1, 2 * p + 4):
        ours = validate(build("dualpipev", p, m))
        torchs = PipelineSchedule.of(get_schedule_ops("DualPipeV", p, m, 2))
        assert [list(map(str, row)) for row in ours.ranks] == [list(map(str, row)) for row in torchs.ranks]
    with pytest.raises(ValueError, match="dualpipev needs m >= 2p"):
        build("dualpipev", p, 2 * p - 1)


def test_the_lower_layers_do_not_import_the_pipeline_package():
    """recsys_pipe.pp sits at the training-adapter level: the engine, the schedule tooling and
    the plan compiler never import it."""
    import subprocess
    import sys

    code = (
        "import sys, recsys_pipe.engine, recsys_pipe.autosched, recsys_pipe.config\n"
        "print(sorted(m for m in sys.modules if m.startswith('recsys_pipe.pp')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


# -- schedules declared in YAML ------------------------------------------------------------------


def test_a_users_yaml_schedule_runs_like_the_shipped_one_it_copies(tmp_path):
    """The shipped files are read like a user's: the same expressions in a file of one's own
    give the same plan and firing order on every rank."""
    from recsys_pipe.pp_schedules.lookahead import LOOKAHEAD_DIR, LOOKAHEAD_SCHEDULES

    assert set(LOOKAHEAD_SCHEDULES) == {"gpipe", "1f1b", "zb_h1", "zb_h2"}
    mine = tmp_path / "mine.yaml"
    mine.write_text((LOOKAHEAD_DIR / "zb_h1.yaml").read_text())
    resolved = resolve_schedule(str(mine), 4, 8, None)
    assert resolved.lookaheads and resolved.ranks_of_stages == (0, 1, 2, 3)
    for r in range(4):
        assert stage_plan(str(mine), 4, r, 8).forward == stage_plan("zb_h1", 4, r, 8).forward
    orders = resolved.compute_orders()
    assert [[(a.kind, a.microbatch) for a in row] for row in orders.ranks] == [
        [(a.kind, a.microbatch) for a in row] for row in build("zb_h1", 4, 8).ranks
    ]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("forward: p - 1 - q\nbackward: 0\n", "integer expression of p, r, m"),
        ("forward: __import__('os')\nbackward: 0\n", "integer expression of p, r, m"),
        ("forward: r - 1\nbackward: 0\n", "forward: -1 for stage 0 of 2"),
        ("forward: p - 1\nbackward: 0\nweight: 0\nextra: 1\n", "extra: Extra inputs are not permitted"),
        ("forward: [1\n", "not YAML"),
        # every stage's backward ahead of its forward: B of a microbatch before its F
        ("forward: 0\nbackward: 1\n", "mine.yaml: "),
    ],
)
def test_a_yaml_schedule_that_does_not_fit_is_a_config_error_naming_the_file(tmp_path, text, fragment):
    from recsys_pipe.config import ConfigError

    mine = tmp_path / "mine.yaml"
    mine.write_text(text)
    with pytest.raises(ConfigError) as info:
        resolve_schedule(str(mine), 2, 4, None)
    (problem,) = info.value.problems
    assert problem.path == "parallel.pp.schedule" and str(mine) in problem.message, problem.message
    assert fragment in problem.message and "\n" not in problem.message, problem.message
    with pytest.raises(ConfigError, match="one stage per rank"):
        resolve_schedule(str(mine), 2, 4, 2)


def test_a_missing_yaml_schedule_is_named():
    from recsys_pipe.config import ConfigError

    with pytest.raises(ConfigError, match="nope.yaml: No such file"):
        resolve_schedule("nope.yaml", 2, 4, None)
