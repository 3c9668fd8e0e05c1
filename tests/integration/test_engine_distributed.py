"""Two ranks, real collectives (gloo): the ordered lock keeps threaded ranks in lockstep, also
with collective tasks skipped by shortcut replay; a skipped task keeps a DDP graph connected."""

import json
from pathlib import Path

import pytest

from recsys_pipe.testing import fork_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_two_ranks_different_thread_maps_never_deadlock_and_match_sequential(tmp_path):
    worker = Path(__file__).resolve().parents[1] / "dist" / "nccl_order_worker.py"
    proc = fork_ranks(worker, str(tmp_path), timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["ok"] for r in ranks)
    assert ranks[0]["results"] == ranks[1]["results"]  # all_reduce: identical on both ranks
    assert len(ranks[0]["results"]) == 6 * 10
    # batch b on rank 0 contributes b+1, on rank 1 b+11: the sum proves matching collectives
    assert ranks[0]["results"]["backward:3"] == [4.0 + 14.0] * 11

    # shortcut replay: two collective tasks skipped on both ranks, the others still matched
    assert all(r["shortcut_ok"] for r in ranks)
    assert ranks[0]["skipped_runs"] == ["start_dist:0", "tokens:0"]  # only the caching runs
    # DDP: the replayed output is grafted, every parameter gets an exact zero gradient after the
    # caching run; a detached replay leaves the parameters unused and DDP stops the next step
    for r in ranks:
        grads = r["ddp_grafted"]["grads"]  # per step: direct.weight, direct.bias, through_mid.*
        assert len(grads) == 5 and all(g > 0 for g in grads[0])
        assert all(step[0] > 0 and step[1] > 0 and step[2:] == [0.0, 0.0] for step in grads[1:])
        assert "finished reduction in the prior iteration" in r["ddp_detached"]["error"]
