"""A Ctrl-C that a library swallows while a command starts still ends the start (`recsys_pipe._ctrl_c`).

fbgemm-gpu imports its optional lookup invokers under a bare `except:`; a Ctrl-C landing there
became a caught KeyboardInterrupt and the command trained on. Here a stand-in module does the
same during its import, in a fresh process: run through the console scripts' guard
(`recsys_pipe.entry._run`), exit 130 and the one line, and `main` never runs; as the model's
module of `recsys-train`, exit 130 and nothing trained. (The real command,
Ctrl-C'd while importing: tests/integration/test_clean_stops.py.)"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from recsys_pipe.testing import worker_env

BIN = Path(sys.executable).parent


SWALLOWS = textwrap.dedent(
    """
    import os, signal, time
    try:  # as fbgemm_gpu.split_embedding_codegen_lookup_invokers does around its optional imports
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler runs (and raises) before this ends
    except:  # noqa: E722
        pass
    def main():
        print("main ran")
    """
)


@pytest.mark.timeout(60)
def test_a_ctrl_c_swallowed_while_importing_ends_the_start(tmp_path):
    (tmp_path / "swallows_ctrl_c.py").write_text(SWALLOWS)
    code = "from recsys_pipe.entry import _run; _run('swallows_ctrl_c', 'recsys-x')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), "RANK": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == ["recsys-x: interrupted (Ctrl-C) while starting; nothing was started"]
    assert "main ran" not in proc.stdout


@pytest.mark.timeout(120)
def test_a_ctrl_c_swallowed_while_the_model_module_loads_ends_the_start(tmp_path):
    """The same inside `recsys-train`, after its own modules loaded: the model's module (a user's
    builder, imported while the config is checked) swallows the Ctrl-C; nothing is trained."""
    tests = Path(__file__).resolve().parents[1]
    (tmp_path / "swallowing_model.py").write_text(SWALLOWS + "from custom_components import build_model\n")
    env = worker_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(tests)]))
    overrides = ["model=custom", "model.builder=swallowing_model:build_model", "+model.hidden=8"]
    overrides += ["data=custom", "data.builder=custom_components:build_data", "trainer=smoke"]
    proc = subprocess.run(
        [str(BIN / "recsys-train"), *overrides, f"trainer.output_dir={tmp_path}/runs"],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 130, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1] == "recsys-train: interrupted (Ctrl-C); nothing was trained"
    assert not list(tmp_path.glob("runs/recsys-train/*/checkpoints/*"))
