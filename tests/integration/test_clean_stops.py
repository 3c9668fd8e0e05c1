"""Clean stops under torchrun's agent (`recsys_pipe.runtime.launcher`, what scripts/train.sh runs):
Ctrl-C and SIGTERM sent to the launcher's process group (what a terminal and `kill -- -PGID` do)
finish the step in flight on every rank, save its checkpoint and exit 130 / 75, with the workers'
code as the launcher's and no traceback. A Ctrl-C while a process starts is one line and 130.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recsys_pipe.runtime.launcher import exit_code_of
from recsys_pipe.testing import worker_env

BIN = Path(sys.executable).parent
CONFIG = [  # long enough to be stopped or to fill a disk
    "trainer=smoke",
    "trainer.max_steps=100000",
    "trainer.epochs=1000",
    "trainer.eval_every=0",
    "trainer.tensorboard=false",
    "trainer.checkpoint.interval=1000",
    "trainer.preemption_check_s=0",
    "data.batch_size=8",
]


def test_exit_code_of_the_workers():
    assert exit_code_of([]) == 0
    assert exit_code_of([130, 130]) == 130 and exit_code_of([75]) == 75
    assert exit_code_of([130, -15], stopping=True) == 130  # the agent terminated the slower rank
    assert exit_code_of([130, -15]) == 143  # without a stop asked for, a killed rank is a failure
    assert exit_code_of([1, 130], stopping=True) == 1 and exit_code_of([2, 75]) == 2
    assert exit_code_of([-9]) == 137


def _leftovers(marker: str) -> list[str]:
    """Processes still running whose command line mentions `marker` (the test's own tmp dir)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in text:
            found.append(text)
    return found


def _stop_mid_run(tmp: Path, sig: signal.Signals) -> tuple[int, str, dict]:
    """Train on 2 ranks under the launcher; send `sig` to its process group at step 6."""
    out = tmp / "runs"
    command = [sys.executable, "-m", "recsys_pipe.runtime.launcher", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.Popen(
        [*command, "--no-python", str(BIN / "recsys-train"), *CONFIG, f"trainer.output_dir={out}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's job
        env=worker_env(),
    )
    lines = []
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[") and "] step 6 |" in line:
            os.killpg(proc.pid, sig)
            break
        assert time.monotonic() < deadline, "".join(lines)
    start = time.monotonic()
    rest, _ = proc.communicate(timeout=120)
    assert time.monotonic() - start < 30  # the step, the checkpoint, the exit: seconds here
    text = "".join(lines) + rest
    assert _leftovers(str(tmp)) == []
    (status,) = out.glob("recsys-train/*/status.json")
    return proc.returncode, text, json.loads(status.read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig, code, state", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 75, "preempted")])
def test_a_signal_stops_every_rank_after_a_step_with_its_checkpoint(tmp_path, sig, code, state):
    rc, text, status = _stop_mid_run(tmp_path, sig)
    assert rc == code, text[-3000:]
    assert "Traceback" not in text and "Error" not in text, text[-3000:]
    assert status["status"] == state and status["exit_code"] == code
    trained = max(int(m) for m in re.findall(r"\] step (\d+) \|", text))
    assert status["step"] == trained >= 6  # no step lost: the checkpoint is of the last step trained
    assert status["checkpoint"].endswith(f"checkpoints/step_{trained}")
    assert (Path(status["checkpoint"]) / ".metadata").is_file()  # a complete DCP save
    for rank in (0, 1):
        assert f"[rank {rank}][WARNING] {sig.name} received: stopped after step {trained} on every rank" in text


@pytest.mark.timeout(120)
def test_ctrl_c_while_starting_is_one_line(tmp_path):
    """SIGINT while recsys-train imports its modules (torch alone takes over a second here)."""
    rendezvous = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    proc = subprocess.Popen(
        [str(BIN / "recsys-train"), "trainer=smoke", f"trainer.output_dir={tmp_path}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k not in rendezvous},  # a plain process, as typed
    )
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 130, err[-3000:]
    assert err.splitlines() == ["recsys-train: interrupted (Ctrl-C) while starting; nothing was started"], err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_ends_the_run_in_one_line_keeping_earlier_checkpoints(tmp_path):
    """The run directory on a 1.2 MB tmpfs: the third checkpoint does not fit. (In one process
    with an injected ENOSPC, without mounting anything: tests/unit/test_checkpoint_errors.py.)"""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"needs to mount a small tmpfs (root): {mounted.stderr.decode().strip()}")
    try:
        command = [sys.executable, "-m", "recsys_pipe.runtime.launcher", "--standalone", "--nproc_per_node", "2"]
        overrides = ["trainer.checkpoint.interval=20", "trainer.checkpoint.keep_latest=0", "trainer.max_steps=300"]
        proc = subprocess.run(
            [*command, "--no-python", str(BIN / "recsys-train"), *CONFIG, *overrides, f"trainer.output_dir={disk}"],
            capture_output=True,
            text=True,
            timeout=240,
            env=worker_env(),
        )
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr, proc.stderr[-3000:]
        (run_dir,) = (disk / "recsys-train").iterdir()
        status = json.loads((run_dir / "status.json").read_text())
        message = status["message"]
        assert status["status"] == "failed" and "No space left on device (ENOSPC)" in message, status
        # the rank whose save failed first reports it; the other says it saw the same
        lines = [line for line in proc.stderr.splitlines() if "[ERROR]" in line]
        assert len(lines) == 2 and all(message in line for line in lines), proc.stderr[-3000:]
        failed = int(re.search(r"checkpoints/step_(\d+):", message).group(1))
        kept = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").iterdir())
        assert kept == list(range(20, failed, 20)) and kept  # every earlier one, no .partial left
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
