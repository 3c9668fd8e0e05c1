"""Suite-wide settings for a small CI box (2 cores): one intra-op thread per process; shared fixtures.

With torch's default thread count, tests (and the torchrun ranks they spawn) oversubscribe the
cores and timings swing by 30x; one thread keeps the suite fast and stable.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)

# Without a GPU, Triton kernels run on CPU tensors in Triton's interpreter, which is read when a
# kernel is defined: set before anything imports the Triton HSTU attention (its tests, and
# `model.attention=triton` in the launcher's tests).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def no_process_group(monkeypatch):
    """Fail, instead of starting a process group, if an input that should be refused slipped through
    to `init_distributed` (patched where recsys-train and recsys-profile find it)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a process group was started for an input that should have been refused")

    import recsys_pipe.runtime
    import recsys_pipe.runtime.session

    for module in (recsys_pipe.runtime, recsys_pipe.runtime.session):
        monkeypatch.setattr(module, "init_distributed", refuse)


@pytest.fixture
def gloo_world():
    """A 1-rank gloo group in this process on an in-memory store (`_process_group.gloo_world`)."""
    from _process_group import gloo_world

    with gloo_world() as group:
        yield group
