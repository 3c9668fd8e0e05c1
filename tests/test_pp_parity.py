"""Pipeline-parallel training on 2 gloo ranks equals the one-rank run and torch's own schedules.

One torchrun launch (tests/dist/pp_parity_worker.py) trains a small dropout MLP split into 2
stages (one per rank) or 4 (two per rank) under every schedule on our engine and under
torch.distributed.pipelining's classes; rank 0 also trains the whole model in one process.
Per-step losses of every microbatch and the final parameters must be bitwise equal.
"""

import pytest
import torch

from recsys_pipe.testing import check_torchrun, run_torchrun

MULTI = ["Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
#: variant -> the rank holding the last stage (its losses); V layouts fold it back to rank 0
VARIANTS = {
    **{f"ours/{name}": 1 for name in ("gpipe", "1f1b", "zb_h1", "zb_h2", "csv_zb_h1")},
    **{f"torch/{name}": 1 for name in ("ScheduleGPipe", "Schedule1F1B", "csv_zb_h1", "csv_zb_h2")},
    **{
        f"{side}/{name}": 0 if name in ("ZBVZeroBubble", "DualPipeV") else 1
        for side in ("ours", "torch")
        for name in MULTI
    },
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_parity")
    check_torchrun(run_torchrun("tests/dist/pp_parity_worker.py", str(out), timeout=240))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


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
