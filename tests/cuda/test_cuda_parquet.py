"""The Parquet sources on CUDA: with `data.pin_memory=true` every tensor of their batches is in
pinned host memory, with and without a DataLoader worker (so the `h2d` task's copies are
asynchronous), the batches are the same as unpinned ones, and `model=dlrm_torch` trains on the
pinned rows through the threaded prefetch plan. The worker (tests/dist/parquet_pin_worker.py)
runs in a subprocess: this directory imports no training stack."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from _launcher_runs import LAUNCHER_PACKAGES, require_packages

pytestmark = pytest.mark.timeout(300)
CPU_COUNTERPART = (
    "tests/unit/test_data_parquet.py and test_data_parquet_train.py check the same batches and training on CPU "
    "(where pinning is off)"
)
WORKER = Path(__file__).resolve().parents[1] / "dist" / "parquet_pin_worker.py"


def test_parquet_batches_are_pinned_and_train_on_cuda(tmp_path):
    require_packages(*LAUNCHER_PACKAGES, "pyarrow")
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), "cuda"], capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "pinned.json").read_text())
    assert report["pinned"] == {
        f"{source}/workers={workers}": True for source in ("parquet", "parquet_sequences") for workers in (0, 1)
    }
    assert report["same_batches"] == {"parquet": True, "parquet_sequences": True}
    assert len(report["losses"]) == 6 and all(math.isfinite(loss) for loss in report["losses"])
