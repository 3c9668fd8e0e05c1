"""Single-process pieces of the training lifecycle: checkpoint files (atomic publish, pruning,
`resume_from` resolution, async snapshot), the LR schedule and clipping, the optimizer's state
round trip, epoch sampling, and the stop request."""

from __future__ import annotations

import copy
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from recsys_pipe.config import ConfigError
from recsys_pipe.data import EpochSampler, RankData, SyntheticConfig, SyntheticDataConfig
from recsys_pipe.runtime import StopRequest
from recsys_pipe.train import (
    CheckpointConfig,
    Checkpointer,
    LrSchedule,
    OptimizerConfig,
    TrainOptimizer,
    find_checkpoints,
    resolve_resume,
)
from recsys_pipe.train.checkpoint import load_checkpoint
from recsys_pipe.train.optim import AdamConfig

# -- checkpoints ------------------------------------------------------------------------------


class _Box:
    """A `Stateful` holding one tensor."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value.copy_(state["value"])


def _checkpointer(run_dir: Path, **cfg) -> Checkpointer:
    return Checkpointer(run_dir, CheckpointConfig.model_validate({"interval": 1, **cfg}), group=None, rank=0)


def test_checkpoints_are_published_complete_and_pruned(tmp_path):
    ckpt = _checkpointer(tmp_path, keep_latest=2)
    published = []
    ckpt.on_published = published.append
    for step in (1, 2, 3):
        ckpt.save(step, {"model": _Box(torch.full((4,), float(step)))}, _Box(torch.tensor([step])))
    assert [c.step for c in find_checkpoints(tmp_path)] == [2, 3]  # keep_latest=2
    assert [c.step for c in published] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2", "step_3"]
    box, rank_box = _Box(torch.zeros(4)), _Box(torch.tensor([0]))
    assert load_checkpoint(tmp_path / "checkpoints" / "step_3", {"model": box}, rank_box, rank=0)
    assert box.value.tolist() == [3.0] * 4 and rank_box.value.item() == 3
    assert not load_checkpoint(tmp_path / "checkpoints" / "step_3", {"model": box}, rank_box, rank=1)  # no rank 1


def test_an_unfinished_save_is_never_visible(tmp_path):
    _checkpointer(tmp_path).save(5, {"model": _Box(torch.ones(2))})
    root = tmp_path / "checkpoints"
    (root / ".step_9.partial").mkdir()  # a crash mid-save: DCP wrote data but no metadata yet
    (root / ".step_9.partial" / "__0_0.distcp").write_bytes(b"half")
    (root / "step_7").mkdir()  # a directory without DCP metadata is not a checkpoint either
    assert [c.step for c in find_checkpoints(tmp_path)] == [5]
    assert resolve_resume(str(tmp_path), "unused") == root / "step_5"
    with pytest.raises(ConfigError, match=r"trainer.resume_from: .*incomplete checkpoint"):
        resolve_resume(str(root / ".step_9.partial"), "unused")


def test_async_save_writes_the_state_of_the_step_it_was_called_at(tmp_path):
    ckpt = _checkpointer(tmp_path, **{"async": True})
    live = torch.arange(1000, dtype=torch.float32)
    ckpt.save(1, {"model": _Box(live)})
    live.add_(1.0)  # training goes on while the background thread writes
    ckpt.wait()
    box = _Box(torch.zeros(1000))
    load_checkpoint(tmp_path / "checkpoints" / "step_1", {"model": box})
    assert torch.equal(box.value, torch.arange(1000, dtype=torch.float32))


def test_resume_from_resolution(tmp_path):
    out = tmp_path / "runs"
    assert resolve_resume(None, str(out)) is None
    assert resolve_resume("latest", str(out)) is None  # nothing yet: a fresh start
    old, new = out / "recsys-train" / "a", out / "recsys-train" / "b"
    _checkpointer(old).save(20, {"m": _Box(torch.ones(1))})
    time.sleep(0.01)
    _checkpointer(new).save(4, {"m": _Box(torch.ones(1))})
    assert resolve_resume("latest", str(out)) == new / "checkpoints" / "step_4"  # the newest written
    assert resolve_resume(str(old), str(out)) == old / "checkpoints" / "step_20"  # a run dir: its newest
    step = old / "checkpoints" / "step_20"
    assert resolve_resume(str(step), str(out)) == step
    with pytest.raises(ConfigError, match="trainer.resume_from: no such checkpoint or run directory"):
        resolve_resume(str(tmp_path / "nope"), str(out))
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        resolve_resume(str(tmp_path), str(tmp_path / "elsewhere"))


# -- schedule, clipping, optimizer state ------------------------------------------------------


def test_lr_schedule_shapes():
    warm = LrSchedule("constant", warmup_steps=4, decay_steps=10)
    assert [warm(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = LrSchedule("linear", warmup_steps=0, decay_steps=10, min_lr_ratio=0.1)
    assert linear(0) == 1.0 and linear(5) == pytest.approx(0.55) and linear(10) == linear(50) == pytest.approx(0.1)
    cosine = LrSchedule("cosine", warmup_steps=2, decay_steps=12)
    assert cosine(2) == 1.0 and cosine(7) == pytest.approx(0.5) and cosine(12) == pytest.approx(0.0, abs=1e-12)
    assert all(cosine(s) >= cosine(s + 1) for s in range(2, 20))


def _optimizer(cfg: OptimizerConfig, total: int = 10, keyed: bool = True) -> tuple[TrainOptimizer, torch.nn.Parameter]:
    """A one-parameter model's optimizer: torchrec's combined optimizer (sharded models) or a
    plain torch one (models with plain torch tables)."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.randn(8))
    if keyed:
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

        dense = KeyedOptimizerWrapper({"w": model.weight}, lambda ps: torch.optim.Adam(ps, lr=cfg.lr))
        return TrainOptimizer(CombinedOptimizer([dense]), cfg, total, model), model.weight
    return TrainOptimizer(torch.optim.Adam(model.parameters(), lr=cfg.lr), cfg, total, model), model.weight


def _train(opt: TrainOptimizer, weight: torch.nn.Parameter, steps: int, scale: float = 100.0) -> list[float]:
    lrs = []
    for i in range(steps):
        opt.zero_grad()
        (scale * (weight * (i + 1)).sum()).backward()
        opt.step()
        lrs.append(opt.last_lr)
    return lrs


def test_clipping_and_schedule_in_train_optimizer():
    cfg = AdamConfig(lr=0.1, schedule="linear", warmup_steps=2, clip_grad_norm=1.0)
    opt, weight = _optimizer(cfg, total=6)
    lrs = _train(opt, weight, 6)
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.075, 0.05, 0.025])
    assert float(opt.last_grad_norm) > 1.0  # the norm before clipping is reported ...
    assert math.isclose(float(weight.grad.norm()), 1.0, rel_tol=1e-5)  # ... and the gradient is clipped


@pytest.mark.parametrize("keyed", [True, False], ids=["torchrec", "plain_torch"])
def test_optimizer_state_round_trip_continues_bitwise(keyed):
    cfg = AdamConfig(lr=0.1, schedule="cosine", warmup_steps=1)
    opt, weight = _optimizer(cfg, keyed=keyed)
    _train(opt, weight, 3)
    saved = copy.deepcopy(opt.state_dict())  # a checkpoint: a snapshot, not views of live state
    snapshot = weight.detach().clone()
    expected = _train(opt, weight, 3)
    after = weight.detach().clone()

    fresh, fresh_weight = _optimizer(cfg, keyed=keyed)
    with torch.no_grad():
        fresh_weight.copy_(snapshot)
    fresh.prepare_load()  # Adam's moments exist only after a step: create them to load into
    fresh.load_state_dict(saved)
    assert fresh.lr == opt.scheduler.base_lrs[0] * opt.scheduler.lr_lambdas[0](3)
    assert _train(fresh, fresh_weight, 3) == expected
    assert torch.equal(fresh_weight.detach(), after)


# -- data by position -------------------------------------------------------------------------


def test_epochs_reshuffle_deterministically_and_resume_by_position():
    sampler = EpochSampler(num_samples=50, batch_size=4, batches_per_epoch=10, epochs=3, shuffle=True, seed=7)
    full = list(sampler)
    assert len(full) == len(sampler) == 120
    epochs = [full[i * 40 : (i + 1) * 40] for i in range(3)]
    assert len({tuple(e) for e in epochs}) == 3  # each epoch its own order ...
    assert epochs[1] == EpochSampler(50, 4, 10, shuffle=True, seed=8).epoch_order(0)  # ... seeded seed + epoch
    assert full == list(EpochSampler(50, 4, 10, epochs=3, shuffle=True, seed=7))
    for start in (0, 3, 10, 17, 30):
        resumed = list(EpochSampler(50, 4, 10, epochs=3, shuffle=True, seed=7, start=start))
        assert resumed == full[start * 4 :], start
    assert list(EpochSampler(50, 4, 10, epochs=2)) == list(range(40)) * 2


def _data(**kw) -> SyntheticDataConfig:
    world = SyntheticConfig(num_items=100, num_users=50, num_clusters=4, num_samples=400)
    return SyntheticDataConfig(**{"batch_size": 8, "max_seq_len": 12, "num_candidates": 3, "synthetic": world, **kw})


def test_training_never_reads_the_held_out_tail():
    data = RankData(_data(shuffle=True), rank=1, world_size=2, eval_batches=3)
    assert data.batches_per_epoch == (200 - 24) // 8
    train = {i for b in data.train_loader(epochs=2) for i in b.sample_ids.tolist()}
    held_out = {i for b in data.eval_loader() for i in b.sample_ids.tolist()}
    assert len(held_out) == 24 and not train & held_out


@pytest.mark.parametrize(
    "kw, eval_batches, fragment",
    [
        ({"num_batches": 30}, 0, "data.num_batches: 30 batches x data.batch_size=8 plus trainer.eval_batches=0"),
        ({"num_batches": 20}, 10, "need 240 samples, but rank 0 of 2 has 200"),
        ({"batch_size": 128}, 1, "data.synthetic.num_samples: too little data: rank 0 of 2 gets 200 samples"),
        ({}, 25, "trainer.eval_batches=25 held-out batches"),
    ],
)
def test_data_too_small_names_the_keys_to_change(kw, eval_batches, fragment):
    with pytest.raises(ConfigError) as info:
        RankData(_data(**kw), rank=0, world_size=2, eval_batches=eval_batches)
    assert fragment in str(info.value)


# -- stop request -----------------------------------------------------------------------------


def test_sigterm_sets_the_stop_request_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert not stop.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not stop.should_stop() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.should_stop() and stop.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before
