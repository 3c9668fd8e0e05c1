"""Pipeline-parallel training on 2 gloo ranks equals the one-rank run and torch's own schedules.

One torchrun launch (tests/dist/pp_parity_worker.py) trains a small dropout MLP split into two
stages under every single-stage schedule on our engine and under torch.distributed.pipelining's
classes; rank 0 also trains the whole model in one process. Per-step losses of every
microbatch and the final parameters must be bitwise equal.
"""

import pytest
import torch

from recsys_pipe.testing import check_torchrun, run_torchrun

VARIANTS = [
    "ours/gpipe",
    "ours/1f1b",
    "ours/zb_h1",
    "ours/zb_h2",
    "torch/ScheduleGPipe",
    "torch/Schedule1F1B",
    "torch/zb_h1",
    "torch/zb_h2",
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_parity")
    check_torchrun(run_torchrun("tests/dist/pp_parity_worker.py", str(out), timeout=180))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _stage_params(reference, stage):
    prefix = f"stages.{stage}."
    return {n[len(prefix) :]: t for n, t in reference["params"].items() if n.startswith(prefix)}


def test_the_one_rank_engine_run_equals_a_plain_loop(ranks):
    engine, loop = ranks[0]["reference/engine"], ranks[0]["reference/loop"]
    assert engine["losses"] == loop["losses"]
    assert engine["params"].keys() == loop["params"].keys()
    assert all(torch.equal(engine["params"][n], loop["params"][n]) for n in engine["params"])


def test_dropout_masks_matter(ranks):
    """The control run draws other masks: a pipelined run that ignored the key would differ."""
    assert ranks[0]["control/shifted_masks"]["losses"] != ranks[0]["reference/loop"]["losses"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_pipelined_run_is_bitwise_the_one_rank_run(ranks, variant):
    reference = ranks[0]["reference/engine"]
    assert ranks[1][variant]["losses"] == reference["losses"]  # the last stage's, per microbatch
    assert ranks[0][variant]["losses"] == [[None] * 4] * 3
    for stage in (0, 1):
        expected = _stage_params(reference, stage)
        got = {n.removeprefix("stage."): t for n, t in ranks[stage][variant]["params"].items()}
        assert got.keys() == expected.keys()
        for name, tensor in got.items():
            assert torch.equal(tensor, expected[name]), f"{variant}: stage {stage} {name}"
