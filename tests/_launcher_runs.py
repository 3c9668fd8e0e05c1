"""Shared by the launcher tests on CPU (tests/integration/test_torch_only.py) and on CUDA
(tests/cuda/test_cuda_launcher.py): run tests/dist/launcher_worker.py, and the assertions on what
it wrote; and the packages those runs need. Imports only the standard library and pytest (the GPU
machine has no torchrec).

Tolerance: bitwise. Every plan runs the same kernels in the same order on the default stream for
the model's math (the plans with lookaheads only move the host-to-device copies to other streams and
threads, which changes no value), and `torch.use_deterministic_algorithms(True)` with
`CUBLAS_WORKSPACE_CONFIG=:4096:8` makes those kernels deterministic on CUDA; megatron-core's DDP at
one rank reduces nothing and adds each gradient to zero (see tests/_dense_ddp.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recsys_pipe.testing import worker_env

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist" / "launcher_worker.py"
#: what the launcher imports beyond torch and the engine (tests/cuda needs no more than those)
LAUNCHER_PACKAGES = ("pydantic", "omegaconf", "hydra", "yaml", "torchmetrics", "tqdm")
#: set by scripts/gpu_check.sh: a missing package fails the test instead of skipping it
STRICT_ENV = "RECSYS_GPU_CHECK"


def require_packages(*names: str) -> None:
    """Skip (fail under gpu_check.sh) unless every package `names` can be imported here."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    if missing:
        reason = (
            f"needs {', '.join(missing)}, which cannot be imported here: bring the wheels (scripts/gpu_wheels.sh) "
            "and run scripts/gpu_check.sh, which installs them"
        )
        if os.environ.get(STRICT_ENV) == "1":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


def run_launcher_worker(
    out_dir: Path,
    device: str,
    variants: list[str],
    steps: int,
    timeout: float = 500,
    model: str = "dlrm_torch",
    block_torchrec: bool = True,
) -> dict:
    """The worker's report for these variants of `model` (one process; torchrec made unimportable
    unless `block_torchrec` is false, as a model with torchrec tables needs)."""
    out = out_dir / "report.json"
    block = ["--block-torchrec"] if block_torchrec else []
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out), "--device", device, "--model", model, *block, "--steps", str(steps)]
        + ["--variants", *variants],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=worker_env(pythonpath=ROOT),
    )
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def assert_runs_match_serial(
    report: dict, steps: int, placement: str, refused: tuple[str, ...] = (), torchrec: bool = False
) -> None:
    """Every variant trained the serial plan's losses bitwise, every step, where `placement` says;
    the `refused` ones exited 2 (config error) without training; torchrec was imported exactly
    when the model has torchrec tables (`torchrec`)."""
    variants = report["variants"]
    reference = variants["serial"]
    assert reference["exit_code"] == 0 and len(reference["losses"]) == steps, reference
    assert len(set(reference["losses"])) > 1  # the losses move: equality is not vacuous
    for name, result in variants.items():
        if name in refused:
            assert result["exit_code"] == 2 and result["losses"] == [], (name, result)
            continue
        assert result["exit_code"] == 0, (name, result)
        assert result["placement"] == placement, (name, result["placement"])
        assert result["losses"] == reference["losses"], f"{name}: {result['losses']} vs serial {reference['losses']}"
    assert report["torchrec_imported"] is torchrec
