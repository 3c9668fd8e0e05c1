"""Ctrl-C at every moment of a run ends it with 130, never ignored, and status.json says what
was saved: during the check and between the check and torchrun in scripts/train.sh, while the
session starts, and while a checkpoint is written (during training: test_clean_stops.py).

The command waits a few seconds at the moment named by `RECSYS_PIPE_PAUSE_AT` (it prints
`paused at <moment>`; `recsys_pipe._ctrl_c.pause_point`); the test then sends SIGINT to its
process group, as a terminal's Ctrl-C does. Every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recsys_pipe.testing import PAUSE_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RUN = ["pipeline=serial", "trainer=smoke", "trainer.eval_every=0", "trainer.tensorboard=false", "data.batch_size=8"]


def _ctrl_c_at(moment: str, command: list[str], tmp: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `command` in a process group of its own, SIGINT the group once it paused at `moment`."""
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", PAUSE_ENV: moment, **(env or {})},
    )
    assert proc.stdout is not None
    lines, deadline = [], time.monotonic() + 120
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == f"paused at {moment}":
            os.killpg(proc.pid, signal.SIGINT)
            break
        assert time.monotonic() < deadline, "".join(lines)
    else:
        pytest.fail(f"never paused at {moment}: {''.join(lines)[-3000:]}")
    rest, _ = proc.communicate(timeout=60)
    return proc.returncode, "".join(lines) + rest


def _status(out: Path) -> dict:
    (status,) = out.glob("recsys-train/*/status.json")
    return json.loads(status.read_text())


@pytest.mark.parametrize("moment", ["check", "exit"])
def test_train_sh_ends_with_130_during_and_right_after_the_check(tmp_path, moment):
    """`exit`: after "config OK", as the check leaves: it used to ignore the signal, and the
    script went on to torchrun and trained to the end."""
    out = tmp_path / "runs"
    command = ["bash", str(ROOT / "scripts" / "train.sh"), *RUN, f"trainer.output_dir={out}"]
    code, text = _ctrl_c_at(moment, command, tmp_path, {"NPROC": "1"})
    assert code == 130, text[-3000:]
    assert ("config OK" in text) == (moment == "exit")
    assert not list(out.glob("recsys-train/*")), text[-3000:]  # torchrun never started: no run directory
    assert "Traceback" not in text


def test_ctrl_c_while_the_session_starts_is_recorded(tmp_path):
    out = tmp_path / "runs"
    code, text = _ctrl_c_at("start", [str(BIN / "recsys-train"), *RUN, f"trainer.output_dir={out}"], tmp_path)
    assert code == 130, text[-3000:]
    status = _status(out)
    assert status["status"] == "interrupted" and status["exit_code"] == 130 and status["checkpoint"] is None
    assert "no checkpoint was written" in text and "Traceback" not in text


def test_ctrl_c_while_a_checkpoint_is_written_names_the_one_written(tmp_path):
    """The checkpoint of step 2 is being written when Ctrl-C comes: it is finished, the run stops
    after the next step with that step's checkpoint (130), and status.json names it; a second
    Ctrl-C during that save would stop at once, naming the step-2 one (`_interrupted`)."""
    out = tmp_path / "runs"
    args = [*RUN, "trainer.max_steps=50", "trainer.checkpoint.interval=2", f"trainer.output_dir={out}"]
    code, text = _ctrl_c_at("checkpoint", [str(BIN / "recsys-train"), *args], tmp_path)
    assert code == 130, text[-3000:]
    status = _status(out)
    assert status["status"] == "interrupted" and status["exit_code"] == 130
    assert status["checkpoint"].endswith(f"checkpoints/step_{status['step']}")
    assert (Path(status["checkpoint"]) / ".metadata").is_file() and status["step"] == 3
    assert "Traceback" not in text
