"""Pipeline-parallel schedules: closed-form bubbles, validation, and torch's schedule CSV format."""

from __future__ import annotations

import pytest

from recsys_pipe.autosched.pipeline_parallel import (
    Action,
    PipelineSchedule,
    PipelineScheduleError,
    build,
    from_csv,
    simulate,
    to_csv,
    validate,
)

# T_W < T_F, T_W <= T_B (ZB-H1's assumptions) and 2 T_W <= T_B (ZB-H2's, see test below)
T_F, T_B, T_W = 1.0, 1.3, 0.6
CASES = [(p, m) for p in (2, 4, 8) for m in (2 * p, 3 * p)]

CLOSED_FORMS = {
    "1f1b": lambda p, f, b, w: (p - 1) * (f + b + w),
    "zb_h1": lambda p, f, b, w: (p - 1) * (f + b - w),
    "zb_h2": lambda p, f, b, w: (p - 1) * (f + b - 2 * w),
}


@pytest.mark.parametrize("name", sorted(CLOSED_FORMS))
@pytest.mark.parametrize("p, m", CASES)
def test_bubble_matches_the_closed_form(name, p, m):
    result = simulate(build(name, p, m), T_F, T_B, T_W)
    assert result.busy == pytest.approx([m * (T_F + T_B + T_W)] * p, abs=1e-9)
    assert result.bubble == pytest.approx(CLOSED_FORMS[name](p, T_F, T_B, T_W), abs=1e-9)
    assert result.makespan == pytest.approx(m * (T_F + T_B + T_W) + result.bubble, abs=1e-9)


@pytest.mark.parametrize("p, m", CASES)
def test_zb_h1_holds_for_other_durations_inside_its_assumptions(p, m):
    f, b, w = 2.0, 1.1, 0.7  # T_W <= min(T_F, T_B); here 2 T_W > T_B, outside ZB-H2's
    assert simulate(build("zb_h1", p, m), f, b, w).bubble == pytest.approx((p - 1) * (f + b - w), abs=1e-9)
    assert simulate(build("1f1b", p, m), f, b, w).bubble == pytest.approx((p - 1) * (f + b + w), abs=1e-9)


@pytest.mark.parametrize("p", [4, 8])
def test_zb_h2_without_optimizer_sync(p):
    # With 2 T_W > T_B the synchronous bubble stays at the last rank's start-up wait (p-1) T_F;
    # the closed form is what each rank idles inside its own window, i.e. what an iteration
    # costs when ranks start the next one without a cross-rank optimizer sync.
    f, b, w = 1.0, 1.2, 0.8
    result = simulate(build("zb_h2", p, 3 * p), f, b, w)
    assert result.bubble == pytest.approx((p - 1) * f, abs=1e-9)
    assert result.bubble_without_sync == pytest.approx((p - 1) * (f + b - 2 * w), abs=1e-9)
    # equal durations: the parallelogram has no bubble at all
    assert simulate(build("zb_h2", p, 3 * p), 1.0, 1.0, 1.0).bubble_without_sync == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("t_fb", [1.7, 2.1, 3.0])
@pytest.mark.parametrize("p, m", [(2, 4), (2, 6), (4, 8), (4, 12), (8, 16), (8, 24)])
def test_dualpipe_matches_the_deepseek_v3_table(p, m, t_fb):
    # DeepSeek-V3: bubble (PP/2 - 1)(F&B + B - 3W) with B a full backward (t_b + t_w here),
    # F&B the overlapped pair. It holds for balanced chunks (T_F = T_B) and an overlap no
    # slower than running the pair back to back and no faster than T_F + T_W.
    f = b = 1.3
    w = 0.4
    result = simulate(build("dualpipe", p, m), f, b, w, t_fb=t_fb)
    assert result.bubble == pytest.approx((p // 2 - 1) * (t_fb + (b + w) - 3 * w), abs=1e-9)
    assert result.peak_activations == (p + 1,) * p  # the table's "PP+1" activations
    stages = build("dualpipe", p, m)
    assert all(len({c.stage for a in row for c in a.computes}) == 2 for row in stages.ranks)  # 2x parameters


def test_peak_activations_match_the_memory_columns():
    p, m = 4, 12
    assert simulate(build("1f1b", p, m), 1, 1, 1).peak_activations == (4, 3, 2, 1)
    assert simulate(build("zb_h1", p, m), 1, 1, 1).peak_activations == (4, 3, 2, 1)
    assert simulate(build("zb_h2", p, m), 1, 1, 1).peak_activations == (7, 5, 3, 1)


def test_every_built_schedule_is_valid_and_complete():
    for name in ("gpipe", "1f1b", "zb_h1", "zb_h2", "dualpipe"):
        schedule = validate(build(name, 4, 8))
        assert schedule.num_microbatches == 8 and schedule.num_ranks == 4
    with pytest.raises(ValueError, match="unknown pipeline schedule 'nope'"):
        build("nope", 2, 4)
    with pytest.raises(ValueError, match="dualpipe needs"):
        build("dualpipe", 3, 6)


def test_strings_follow_torch():
    assert str(Action("B", 2, 5)) == "2I5" and str(Action("BW", 0, 1)) == "0B1"
    assert Action.parse("3SEND_F4") == Action("SEND_F", 3, 4)
    assert Action.parse("1REDUCE_GRAD") == Action("REDUCE_GRAD", 1)
    fb = Action.parse("(0F2;3B0)OVERLAP_F_B")
    assert fb.parts == (Action("F", 0, 2), Action("BW", 3, 0)) and str(fb) == "(0F2;3B0)OVERLAP_F_B"
    assert Action.parse("") is None
    with pytest.raises(ValueError, match="cannot parse action '0X1'"):
        Action.parse("0X1")


@pytest.mark.parametrize(
    "ranks, fragment",
    [
        ([["0F0", "0B0"], ["1B0", "1F0"]], "rank 1: the backward of 1F0 comes before it"),
        ([["0F0", "0W0", "0I0"]], "rank 0: 0W0 comes before 0I0"),
        ([["0F0", "0I0"]], "microbatch 0 on stage 0 has no W"),
        ([["0F0", "0F0", "0B0"]], "rank 0: 0F0 appears twice"),
        ([["0F0", "0B0"], ["0F1", "0B1"]], "rank 1: 0F1: stage 0 already runs on rank 0"),
        ([["0F0", "0B0"], ["1F0", "1F1", "1B0", "1B1"]], "microbatch 1 through [1], microbatch 0 through [0, 1]"),
        ([["0F0", "0SEND_F0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]], "rank 0: missing 0RECV_B0"),
        (
            [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]],
            "deadlock: no rank can proceed; rank 0: 0B0 waits for rank 1: 1B0 (gradient 1->0 of microbatch 0); "
            "rank 1: 1F1 waits for rank 0: 0F1 (activation 0->1 of microbatch 1)",
        ),
    ],
)
def test_validate_names_the_broken_actions(ranks, fragment):
    with pytest.raises(PipelineScheduleError) as info:
        validate(ranks)
    assert fragment in str(info.value)


def test_communication_takes_t_comm_between_ranks():
    # 0F0 [0,1]; activation [1,1.5]; 1F0 [1.5,2.5]; 1BW0 [2.5,4.5]; gradient [4.5,5]; 0BW0 [5,7]
    explicit = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    implicit = [["0F0", "0B0"], ["1F0", "1B0"]]
    for ranks in (explicit, implicit):
        result = simulate(ranks, 1.0, 1.0, 1.0, t_comm=0.5)
        assert result.makespan == 7.0 and result.busy == (3.0, 3.0) and result.bubble == 4.0
    # with explicit communication a transfer starts once both sides are posted: rank 1 posts
    # the receive of microbatch 1 only after its first backward (4.5), not when 0F1 is sent (2)
    explicit = [
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
        ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"],
    ]
    assert simulate(explicit, 1.0, 1.0, 1.0, t_comm=0.5).makespan == 10.5
    implicit = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    assert simulate(implicit, 1.0, 1.0, 1.0, t_comm=0.5).makespan == 10.0


def test_sending_costs_the_sending_rank_t_send():
    # 0F0 + its send [0,1.25]; activation [1.25,1.75]; 1F0 [1.75,2.75]; 1BW0 + its send
    # [2.75,5]; gradient [5,5.5]; 0BW0 [5.5,7.5] (the first stage sends nothing back)
    implicit = [["0F0", "0B0"], ["1F0", "1B0"]]
    result = simulate(implicit, 1.0, 1.0, 1.0, t_comm=0.5, t_send=0.25)
    assert result.makespan == 7.5 and result.busy == (3.25, 3.25)
    # explicit sends take it themselves, not the computes
    explicit = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    assert simulate(explicit, 1.0, 1.0, 1.0, t_comm=0.5, t_send=0.25).busy == (3.25, 3.25)
    with pytest.raises(ValueError, match="t_send"):
        simulate(implicit, 1.0, 1.0, 1.0, t_send=-1.0)


def test_plot_writes_a_png(tmp_path):
    out = simulate(build("dualpipe", 4, 8), 1.0, 1.0, 0.5, t_fb=1.8).plot(tmp_path / "dualpipe.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


# -- torch.distributed.pipelining's schedule format ---------------------------------------------------


def _torch_schedule(cls, p: int, m: int):
    """A torch multi-stage schedule built without a process group (stages only need their sizes)."""
    from types import SimpleNamespace

    n = 2 * p
    stages = [
        SimpleNamespace(
            num_stages=n, group_size=p, group_rank=0, stage_index=i, is_first=i == 0, is_last=i == n - 1, submod=None
        )
        for i in (0, n - 1)
    ]
    return cls(stages, m)


@pytest.mark.parametrize("name", ["ScheduleZBVZeroBubble", "ScheduleDualPipeV"])
def test_csv_round_trip_with_torchs_serialiser_and_parser(tmp_path, name):
    import torch.distributed.pipelining.schedules as torch_schedules

    torch_schedule = _torch_schedule(getattr(torch_schedules, name), 4, 8)
    for fmt, order in (
        ("compute_only", torch_schedule.pipeline_order),
        ("compute_comms", torch_schedule.pipeline_order_with_comms),
    ):
        written = tmp_path / f"{fmt}.csv"
        torch_schedule._dump_csv(written, format=fmt)  # torch's serialiser
        ours = validate(from_csv(written))
        expected = {r: [str(a) for a in row if a is not None] for r, row in order.items()}
        assert {r: [str(a) for a in row] for r, row in enumerate(ours.ranks)} == expected
        back = tmp_path / f"{fmt}-ours.csv"
        to_csv(ours, back)
        parsed = [  # torch's parser on our file
            [torch_schedules._Action.from_str(cell) for cell in line.split(",")]
            for line in back.read_text().splitlines()
        ]
        assert parsed == [[a for a in order[r] if a is not None] for r in range(len(order))]
        result = simulate(ours, 1.0, 1.0, 1.0, t_comm=0.1 if fmt == "compute_comms" else 0.0)
        assert result.busy == pytest.approx([2 * 8 * 3.0] * 4)  # two stages per rank, 8 microbatches
    if name == "ScheduleZBVZeroBubble":  # ZB-V: no bubble inside a rank's window when T_F = T_B = T_W
        assert simulate(from_csv(tmp_path / "compute_only.csv"), 1.0, 1.0, 1.0).bubble_without_sync == 0.0


def test_our_schedules_export_to_torchs_format(tmp_path):
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    text = to_csv(build("zb_h1", 4, 8))
    rows = [[_Action.from_str(cell) for cell in line.split(",")] for line in text.splitlines()]
    fwd, inp, wgt = _ComputationType.FORWARD, _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT
    assert [a.computation_type for a in rows[0][:6]] == [fwd, fwd, fwd, fwd, inp, wgt]
    assert from_csv(text) == PipelineSchedule.of(build("zb_h1", 4, 8).ranks)
    one = to_csv(build("1f1b", 2, 4))
    assert one.splitlines()[1] == "1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3"  # torch "B": full backward
