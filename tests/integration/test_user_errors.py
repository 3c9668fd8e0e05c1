"""The failure catalogue, continued: a bug in the user's own code (a data or model builder, their
model's forward) is reported as one line naming the config key and the exception, then the
frames of the user's code; no Hydra wrapper, no HYDRA_FULL_ERROR hint, no frames of ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

BIN = Path(sys.executable).parent
TESTS = Path(__file__).resolve().parents[1]

USER_CODE = """
import torch
from custom_components import ClicksConfig, PooledConfig, build_model as pooled


def lookup(table, key):
    return table[key]


def build_data(cfg: ClicksConfig, rank: int, world_size: int):
    return lookup({}, "rows")


def build_model(cfg: PooledConfig, spec):
    raise ValueError("bad width")


class Broken(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, batch):
        loss, out = self.inner(batch)
        return loss / torch.zeros(3, 3).sum(dim=7), out


def build_broken(cfg: PooledConfig, spec):
    return Broken(pooled(cfg, spec))
"""

CUSTOM = ["model=custom", "data=custom", "data.builder=custom_components:build_data"]


def _train(tmp: Path, *overrides: str) -> tuple[int, str]:
    (tmp / "user_pkg.py").write_text(USER_CODE)
    proc = subprocess.run(
        [str(BIN / "recsys-train"), "trainer=smoke", f"trainer.output_dir={tmp / 'runs'}", *overrides],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(TESTS)]), "OMP_NUM_THREADS": "1"},
    )
    return proc.returncode, proc.stderr


def _assert_user_report(err: str, head: str, frames: list[str], tmp: Path) -> None:
    start = err.index("error: ")
    lines = err[start:].splitlines()
    assert lines[0] == head
    files = [line.strip() for line in lines[1:] if line.strip().startswith("File ")]
    assert files == [f'File "{tmp / "user_pkg.py"}", line {n}, in {fn}' for n, fn in frames]
    assert "Traceback" not in err and "HYDRA_FULL_ERROR" not in err and "Error executing job" not in err
    assert "recsys_pipe" not in err[start:]


def test_data_builder_bug_before_start(tmp_path):
    code, err = _train(
        tmp_path, *CUSTOM[:2], "model.builder=custom_components:build_model", "data.builder=user_pkg:build_data"
    )
    assert code == 1
    _assert_user_report(
        err,
        "error: data.builder (user_pkg:build_data) raised KeyError: 'rows'",
        [(11, "build_data"), (7, "lookup")],
        tmp_path,
    )


def test_model_builder_bug_after_start_is_recorded(tmp_path):
    code, err = _train(tmp_path, *CUSTOM, "model.builder=user_pkg:build_model")
    assert code == 1
    head = "error: model.builder (user_pkg:build_model) raised ValueError: bad width"
    _assert_user_report(err, head, [(15, "build_model")], tmp_path)
    (status,) = (tmp_path / "runs" / "recsys-train").glob("*/status.json")
    record = json.loads(status.read_text())
    assert record["status"] == "failed" and record["message"] == head.removeprefix("error: ")


def test_model_forward_bug_names_the_task_and_the_users_frames(tmp_path):
    code, err = _train(tmp_path, *CUSTOM, "model.builder=user_pkg:build_broken", "pipeline=serial")
    assert code == 1
    head = (
        "error: model.builder (user_pkg:build_broken) raised IndexError: "
        "Dimension out of range (expected to be in range of [-2, 1], but got 7)"
    )
    _assert_user_report(err, head, [(25, "forward")], tmp_path)
