"""Shared by the `trainer.dense_ddp` tests on CPU (tests/integration/test_dense_ddp.py) and on CUDA
(tests/cuda/test_cuda_megatron.py): run tests/dist/dense_ddp_worker.py, and the assertions on what
it recorded. Imports only the standard library, pytest and torch (the GPU machine has no torchrec).

Tolerance: bitwise (zeros compared by value, as `torch.equal` does: -0.0 == +0.0), for one and
two ranks. The megatron run must give the torch DDP run's losses, gradients and parameters
exactly: megatron-core adds each gradient into a zeroed buffer (exact) and scales it by 1/world
size around a SUM all-reduce, as torch DDP does (scaling by 1 or 1/2 is exact, and a sum of two
values does not depend on their order), and the same torch optimizer then steps on the same
numbers. Every plan must give the serial plan's numbers, as everywhere in this project.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from recsys_pipe.testing import worker_env

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist" / "dense_ddp_worker.py"
PLANS = ("serial", "hstu_prefetch")


def run_worker(out: Path, device: str, nproc: int = 1, steps: int = 12, timeout: float = 400) -> list[dict]:
    """The worker's results, one dict per rank (a plain process for one rank, torchrun for more)."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if nproc > 1:
        launcher += ["--nproc_per_node", str(nproc)]
    proc = subprocess.run(
        [*launcher, str(WORKER), str(out), "--device", device, "--steps", str(steps)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=worker_env(pythonpath=ROOT),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str:
    """Where two sets of tensors differ most (for a failure message)."""
    worst = max(a, key=lambda name: float((a[name] - b[name]).abs().max()))
    return f"largest difference {float((a[worst] - b[worst]).abs().max()):.3e} in {worst}"


def assert_same_training(result: dict, reference: dict, what: str) -> None:
    """`result` trained `reference`'s numbers bitwise: every loss, gradient and parameter."""
    assert len(result["losses"]) == len(reference["losses"]) > 0, what
    assert result["losses"] == reference["losses"], f"{what}: losses differ {result['losses']} vs {reference['losses']}"
    for kind in ("grad", "param"):
        steps = [s for s, (x, y) in enumerate(zip(result[f"{kind}_digests"], reference[f"{kind}_digests"])) if x != y]
        last = max_difference(result[f"last_{kind}s"], reference[f"last_{kind}s"])
        assert not steps, f"{what}: {kind}s differ after step(s) {steps}; after the last one: {last}"
        assert len(result[f"{kind}_digests"]) == len(reference["losses"]), what


def assert_megatron_matches_torch(ranks: list[dict], device: str) -> None:
    """Per rank: megatron == torch DDP == serial plan, bitwise; the megatron run wired as intended."""
    for rank, results in enumerate(ranks):
        assert results["torchrec_imported"] is False
        reference = results["torch/serial"]
        for plan in PLANS:
            for dense in ("torch", "megatron"):
                assert_same_training(results[f"{dense}/{plan}"], reference, f"rank {rank}: {dense} DDP, plan {plan}")
            wiring = results[f"megatron/{plan}"]["wiring"]
            assert wiring == {
                "grad_buffers": "MegatronGrads",
                "model_parallel_initialized": True,
                "data_parallel_size": len(ranks),
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "grad_buffer_devices": [f"{device}:0" if device == "cuda" else "cpu"],
                "grads_are_buffer_views": True,
                "model_parallel_initialized_after_close": False,
            }, wiring
        # the comparison is not vacuous: the parameters and the loss changed during training
        first, last = reference["param_digests"][0], reference["param_digests"][-1]
        assert first != last and len(set(reference["losses"])) > 1
    if len(ranks) > 1:  # data parallel: every rank holds the same parameters, trained on its own batches
        for plan in PLANS:
            digests = {tuple(r[f"megatron/{plan}"]["param_digests"]) for r in ranks}
            assert len(digests) == 1, f"megatron/{plan}: ranks hold different parameters"
        assert ranks[0]["torch/serial"]["losses"] != ranks[1]["torch/serial"]["losses"]
