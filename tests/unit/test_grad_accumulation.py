"""trainer.grad_accumulation: the per-micro-step rules against torchrec's own wrapper, and the
settings it refuses. (End to end, bitwise against torchrec's GradientAccumulationWrapper on 2
ranks: tests/integration/test_train_parity.py.)"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from recsys_pipe.config import ConfigError
from recsys_pipe.testing import load_run
from recsys_pipe.train.grad_accumulation import GradAccumulation, GradAccumulationConfig


class _CountingOptimizer:
    """Records which calls reach the real optimizer."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls.append("zero_grad")

    def step(self) -> None:
        self.calls.append("step")


@settings(max_examples=200, deadline=None)
@given(steps=st.integers(1, 6), warmup=st.integers(1, 8), micro_steps=st.integers(1, 30))
def test_rules_match_torchrecs_wrapper(steps, warmup, micro_steps):
    """Sync, zero_grad and step decisions per micro-step equal those torchrec's wrapper takes
    around a pipeline that calls zero_grad, then step, once per progress (as TrainPipelineSparseDist)."""
    from torchrec.distributed.train_pipeline import GradientAccumulationConfig as TorchrecConfig
    from torchrec.distributed.train_pipeline import GradientAccumulationWrapper

    optimizer = _CountingOptimizer()
    wrapper = GradientAccumulationWrapper(None, optimizer, nn.Linear(2, 2), TorchrecConfig(steps > 1, steps, warmup))
    ours = GradAccumulation(GradAccumulationConfig(steps=steps, warmup_steps=warmup), nn.Linear(2, 2))
    expected: list[str] = []
    for step in range(micro_steps):
        wrapper.set_step(step)
        if steps > 1:
            assert ours.syncs(step) == wrapper._should_sync_grad(), step
        wrapper.optimizer_wrapper.zero_grad()
        wrapper.optimizer_wrapper.step()
        expected += ["zero_grad"] * ours.clears_grad(step) + ["step"] * ours.steps_optimizer(step)
    assert optimizer.calls == expected
    assert ours.pending(micro_steps) == (micro_steps % steps != 0)


def test_no_sync_on_the_accumulating_micro_steps_only():
    """DDP's all-reduce flag is off inside grad_sync exactly where torchrec skips the sync."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    own_group = not dist.is_initialized()
    if own_group:  # a 1-rank group in this process, removed again (no environment variables)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DistributedDataParallel(nn.Linear(2, 2))
        ours = GradAccumulation(GradAccumulationConfig(steps=3, warmup_steps=2), model)
        assert ours.ddp_modules == [model]
        flags = []
        for step in range(7):
            with ours.grad_sync(step):
                flags.append(model.require_backward_grad_sync)
        assert flags == [True, True, True, False, False, True, False]  # 0, warmup, window ends (2, 5)
    finally:
        if own_group:
            dist.destroy_process_group()


@pytest.mark.parametrize(
    ("overrides", "path"),
    [
        (["trainer.grad_accumulation.steps=0"], "trainer.grad_accumulation.steps"),
        (["trainer.grad_accumulation.warmup_steps=0"], "trainer.grad_accumulation.warmup_steps"),
    ],
)
def test_bad_values_name_their_config_path(overrides, path):
    with pytest.raises(ConfigError) as info:
        load_run(*overrides)
    assert path in str(info.value)


def test_checkpoint_inside_a_window_is_refused_before_anything_starts():
    with pytest.raises(ConfigError) as info:
        load_run("trainer.grad_accumulation.steps=4", "trainer.checkpoint.interval=10")
    assert "trainer.checkpoint.interval=10 is not a multiple of trainer.grad_accumulation.steps=4" in str(info.value)
    assert (
        load_run("trainer.grad_accumulation.steps=4", "trainer.checkpoint.interval=8").trainer.checkpoint.interval == 8
    )


def test_scale_loss():
    assert GradAccumulation(GradAccumulationConfig(steps=4, scale_loss=True), nn.Linear(1, 1)).loss_scale == 0.25
    assert GradAccumulation(GradAccumulationConfig(steps=4), nn.Linear(1, 1)).loss_scale == 1.0
