"""Pipeline-parallel training on 2 gloo ranks equals the one-rank run and torch's own schedules.

One torchrun launch (tests/dist/pp_parity_worker.py) trains a small dropout MLP split into 2
stages (one per rank) or 4 (two per rank) under every schedule on our engine and under
torch.distributed.pipelining's classes; rank 0 also trains the whole model in one process.
Per-step losses of every microbatch and the final parameters must be bitwise equal.
"""

import pytest
import torch

from recsys_pipe.autosched.pipeline_parallel import build, measured_result, simulate
from recsys_pipe.testing import check_torchrun, fork_ranks

pytestmark = pytest.mark.slow  # torchrun launches

MULTI = ["Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
#: variant -> the rank holding the last stage (its losses); V layouts fold it back to rank 0
VARIANTS = {
    **{f"ours/{name}": 1 for name in ("gpipe", "1f1b", "zb_h1", "zb_h2", "csv_zb_h1")},
    **{f"torch/{name}": 1 for name in ("ScheduleGPipe", "Schedule1F1B", "csv_zb_h1", "csv_zb_h2")},
    # ZB-H2 checkpointed after step 0 (stage parameters and optimizer state only) and resumed
    # in new stages and engine plans: no RNG state needed, the dropout masks are keyed by step
    "resumed/zb_h2": 1,
    **{
        f"{side}/{name}": 0 if name in ("ZBVZeroBubble", "DualPipeV") else 1
        for side in ("ours", "torch")
        for name in MULTI
    },
}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_parity")
    check_torchrun(fork_ranks("tests/dist/pp_parity_worker.py", str(out), timeout=240))
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def ranks(launch):
    return launch[1]


def _assert_same_params(got, expected, what):
    assert got.keys() == expected.keys(), what
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), f"{what}: {name}"


def test_the_one_rank_engine_run_equals_a_plain_loop(ranks):
    engine, loop = ranks[0]["reference/engine"], ranks[0]["reference/loop"]
    assert engine["losses"] == loop["losses"]
    _assert_same_params(engine["params"], loop["params"], "engine vs loop")


def test_dropout_masks_matter(ranks):
    """The control run draws other masks: a pipelined run that ignored the key would differ."""
    assert ranks[0]["control/shifted_masks"]["losses"] != ranks[0]["reference/loop"]["losses"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pipelined_run_is_bitwise_the_one_rank_run(ranks, variant):
    reference = ranks[0]["reference/engine"]
    last = VARIANTS[variant]
    assert ranks[last][variant]["losses"] == reference["losses"]  # the last stage's, per microbatch
    assert ranks[1 - last][variant]["losses"] == [[None] * 4] * 2
    params = {**ranks[0][variant]["params"], **ranks[1][variant]["params"]}
    _assert_same_params(params, reference["params"], variant)


@pytest.mark.parametrize(("variant", "schedule"), [("ours/zb_h1", "zb_h1"), ("ours/DualPipeV", "dualpipev")])
def test_each_rank_ran_its_declared_order_and_its_timeline_measures_like_the_simulator(ranks, variant, schedule):
    """The engine's spans of a real step: each rank's compute steps in exactly the declared
    order, one at a time; as a PipelineResult they carry the simulator's measures."""
    declared = build(schedule, 2, 4)
    per_rank = [ranks[r][variant]["spans"] for r in range(2)]
    for r, spans in enumerate(per_rank):
        assert [s.action for s in spans] == [str(c) for a in declared.ranks[r] for c in a.computes]
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:])), "a rank runs one step at a time"
    measured = measured_result(per_rank, schedule)
    assert 0 < max(measured.busy) <= measured.makespan and measured.bubble >= 0
    assert measured.peak_activations == simulate(declared, 1, 1, 1).peak_activations


@pytest.mark.parametrize(
    ("variant", "reference", "last"),
    [
        ("hstu/1f1b", "hstu/reference2", 1),
        ("hstu/zb_h1", "hstu/reference2", 1),
        ("hstu/dualpipev", "hstu/reference4", 0),
        ("sasrec/1f1b", "sasrec/reference2", 1),
        ("sasrec/zb_h2", "sasrec/reference2", 1),
    ],
)
def test_models_pipelined_are_bitwise_the_one_rank_run(ranks, variant, reference, last):
    """HSTU ranking (the main job's model) and SASRec split into stages (embeddings on the
    first, head and loss on the last; SASRec's tied item rows travel to the loss) train 2 steps
    of 4 microbatches bitwise as on one rank."""
    expected = ranks[0][reference]
    assert ranks[last][variant]["losses"] == expected["losses"]
    params = {**ranks[0][variant]["params"], **ranks[1][variant]["params"]}
    _assert_same_params(params, expected["params"], variant)


def test_the_measured_gantt_is_drawn(launch):
    out, _ = launch
    assert (out / "zb_h1_measured.png").stat().st_size > 1000


@pytest.fixture(scope="module")
def mesh_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_dp")
    check_torchrun(fork_ranks("tests/dist/pp_dp_worker.py", str(out), nproc=4, timeout=240))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


@pytest.mark.parametrize("variant", ["ours/1f1b", "ours/zb_h2", "ours/ZBVZeroBubble"])
def test_pp_times_dp_on_4_ranks_is_bitwise_the_one_rank_run(mesh_ranks, variant):
    """2 stages x 2 replicas: each replica's pipeline trains its share of the batch, the stages'
    gradients are averaged over the replicas; the reference is one process over both shares."""
    reference = mesh_ranks[0]["reference"]
    assert [r["coords"] for r in mesh_ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # rank = pp * 2 + dp
    for replica in (0, 1):
        ranks = [r for r in mesh_ranks if r["coords"][1] == replica]
        params = {name: t for r in ranks for name, t in r[variant]["params"].items()}
        _assert_same_params(params, reference["params"], f"{variant}, replica {replica}")
        (last,) = [r for r in ranks if r[variant]["losses"][0][0] is not None]
        assert last[variant]["losses"] == [step[replica] for step in reference["losses"]]
