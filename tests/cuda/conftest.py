"""tests/cuda: the engine on real CUDA streams, events and threads.

They need a CUDA device; where none is visible every test here is skipped with the reason below
(CI is CPU-only). `scripts/gpu_check.sh` runs them on a GPU machine. Their CPU counterparts are
the recording-stream tests (tests/test_engine_*.py), which check the same orderings symbolically.
This directory imports only torch, the engine, pytest and hypothesis, so it runs where the
training stack (torchrec, fbgemm) is not installed.
"""

from pathlib import Path

import pytest
import torch

from recsys_pipe.engine.testing import cuda_spin

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason=(
            f"no CUDA device is visible (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
            "tests/cuda run on a GPU machine (scripts/gpu_check.sh), the recording-stream tests in "
            "tests/test_engine_*.py check the same orderings on CPU"
        )
    )
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def calibrated_spin():
    """Measure the spin kernel's clock rate once, before any test times anything with it."""
    if torch.cuda.is_available():
        cuda_spin(0.01)
        torch.cuda.synchronize()
