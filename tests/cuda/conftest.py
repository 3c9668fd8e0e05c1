"""tests/cuda: the engine on real CUDA streams, events and threads.

They need a CUDA device; where none is visible every test here is skipped with the reason below
(CI is CPU-only). `scripts/gpu_check.sh` runs them on a GPU machine. The CPU counterparts of the
engine tests are the recording-stream tests (tests/test_engine_*.py), which check the same
orderings symbolically; a module whose counterpart is elsewhere names it in `CPU_COUNTERPART`.
This directory imports only torch, the engine, pytest and hypothesis, so it runs where the
training stack (torchrec, fbgemm) is not installed. The launcher and megatron tests
(test_cuda_launcher.py, test_cuda_megatron.py) train in subprocesses, which also need the
launcher's packages and megatron-core (carried as wheels); without them those tests skip, or
fail under gpu_check.sh.
"""

from pathlib import Path

import pytest
import torch

from recsys_pipe.engine.testing import cuda_spin

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            counterpart = getattr(
                item.module,
                "CPU_COUNTERPART",
                "the recording-stream tests in tests/test_engine_*.py check the same orderings on CPU",
            )
            reason = (
                f"no CUDA device is visible (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
                f"tests/cuda run on a GPU machine (scripts/gpu_check.sh), {counterpart}"
            )
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session", autouse=True)
def calibrated_spin():
    """Measure the spin kernel's clock rate once, before any test times anything with it."""
    if torch.cuda.is_available():
        cuda_spin(0.01)
        torch.cuda.synchronize()
