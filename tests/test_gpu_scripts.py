"""The GPU scripts on a machine without a GPU: argument handling, the "no CUDA" answer, the order of
gpu_check.sh's steps and its summary, bench_gpu.py's plan on CPU, and that what runs on the GPU
machine imports nothing of the training stack (which is not installed there)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _launcher_runs import STRICT_ENV, require_packages

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"
GPU_WHEELS = ROOT / "scripts" / "gpu_wheels.sh"
BENCH_GPU = ROOT / "scripts" / "bench_gpu.py"
BENCH_ENGINE = ROOT / "scripts" / "bench_engine.py"

pytestmark = pytest.mark.timeout(200)

# Python code that makes the training stack unimportable, as on the GPU machine.
WITHOUT_TRAINING_STACK = """
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torchrec", "fbgemm_gpu", "megatron", "hydra", "pydantic", "omegaconf"}:
            raise ImportError(f"{name} is not installed on the GPU machine")
sys.meta_path.insert(0, _Absent())
"""


def run(command, timeout=150, **kwargs):
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kwargs)


def run_script_without_training_stack(script, *args):
    code = WITHOUT_TRAINING_STACK + f"import runpy; sys.argv = [{str(script)!r}, *{list(args)!r}]\n"
    code += f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    return run([sys.executable, "-c", code])


# -- gpu_check.sh ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "unknown argument '--bogus'"),
        (["--out"], "--out needs a value"),
        (["--wheels", "/nonexistent/wheels"], "--wheels /nonexistent/wheels is not a directory"),
        (["--python", "/nonexistent/python"], "python '/nonexistent/python' not found"),
    ],
)
def test_gpu_check_bad_arguments_exit_2_with_one_line(args, message):
    out = run(["bash", str(GPU_CHECK), *args])
    assert out.returncode == 2
    assert out.stderr == f"gpu_check: {message} (see --help)\n"


def test_gpu_check_help():
    out = run(["bash", str(GPU_CHECK), "--help"])
    assert out.returncode == 0 and out.stdout.startswith("usage: scripts/gpu_check.sh")


def test_gpu_check_without_a_gpu_says_so_and_runs_nothing(tmp_path):
    out = run(["bash", str(GPU_CHECK), "--python", sys.executable, "--out", str(tmp_path / "out")])
    assert out.returncode == 3
    assert "gpu_check: no CUDA GPU is visible to" in out.stderr and "nothing was run" in out.stderr
    assert not (tmp_path / "out").exists()


def test_gpu_check_runs_every_step_and_summarises(tmp_path):
    """The whole sequence as on the GPU machine, with an interpreter that answers the GPU probe as
    a GPU machine would and is the real one otherwise, the training stack made unimportable (a
    `sitecustomize`): tests/cuda (the engine's, the launcher's, megatron's) are collected and skip,
    bench_gpu.py finds no CUDA and fails, bench_engine.py runs without the shipped plans; the
    summary shows each and the check fails."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$*" == *"torch.cuda.is_available()"* && "$*" == *\'sep="|"\'* ]]; then\n'
        '  echo "2.11.0+cu130|13.0|True"; exit 0\n'
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(WITHOUT_TRAINING_STACK)
    (tmp_path / "no_wheels").mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "PYTEST_ADDOPTS": "-p no:hydra_pytest"}
    out_dir = tmp_path / "out"
    out = run(
        ["bash", str(GPU_CHECK), "--python", str(fake), "--quick", "--out", str(out_dir)]
        + ["--wheels", str(tmp_path / "no_wheels")],
        timeout=180,
        env=env,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    summary = (out_dir / "summary.txt").read_text().splitlines()
    rows = {line.split()[0]: line for line in summary[2:-1]}
    assert list(rows) == ["cuda_tests", "launcher_cuda", "megatron_cuda", "bench_gpu", "bench_engine", "profiler"]
    assert " passed " in rows["cuda_tests"] and " skipped" in rows["cuda_tests"]
    assert "1 skipped" in rows["launcher_cuda"] and "1 skipped" in rows["megatron_cuda"]
    assert "test_cuda_launcher" not in (out_dir / "cuda_tests.log").read_text()  # each test in one step only
    assert "failed (exit 2)" in rows["bench_gpu"] and "no report" in rows["bench_gpu"]
    assert " passed " in rows["bench_engine"] and "µs/task" in rows["bench_engine"]
    assert "shipped plans skipped: ImportError: " in rows["bench_engine"]
    assert summary[-1] == "overall: FAILED"
    assert out.stdout.rstrip().endswith("overall: FAILED")
    assert json.loads((out_dir / "bench_engine.json").read_text())["plans"] == {}
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "bench_engine.json",
        "bench_engine.log",
        "bench_gpu.log",
        "cuda_tests.log",
        "launcher_cuda.log",
        "megatron_cuda.log",
        "summary.txt",
    ]


def test_gpu_wheels_arguments():
    """(Downloading needs a package index: checked by hand, see README.)"""
    out = run(["bash", str(GPU_WHEELS), "--help"])
    assert out.returncode == 0 and "bash scripts/gpu_wheels.sh [--dir DIR] [REQUIREMENT ...]" in out.stdout
    assert "set -euo" not in out.stdout  # the help is the comment block, nothing after it
    out = run(["bash", str(GPU_WHEELS), "--bogus"])
    assert out.returncode == 2 and out.stderr == "gpu_wheels: unknown option '--bogus' (see --help)\n"
    out = run(["bash", str(GPU_WHEELS), "--dir"])
    assert out.returncode == 2 and out.stderr == "gpu_wheels: --dir needs a directory\n"


# -- bench_gpu.py --------------------------------------------------------------------------------------


def test_bench_gpu_cpu_smoke_trains_every_configuration_like_serial():
    out = run_script_without_training_stack(BENCH_GPU, "--device", "cpu", "--quick")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) == {
        "machine",
        "configs",
        "off_default_share_of_serial",
        "overhead_us_per_task",
        "numerics",
        "targets",
    }
    assert list(report["configs"]) == ["serial", "pipelined_sequential", "pipelined_threaded"]
    assert report["numerics"]["losses_bitwise_equal_to_serial"] == {
        "pipelined_sequential": True,
        "pipelined_threaded": True,
    }
    for config in ("pipelined_sequential", "pipelined_threaded"):
        busy = report["configs"][config]["busy_ms"]
        assert busy["comm"]["median"] >= 0.4  # the 0.5 ms communication sleep ran on its stream
        assert busy["default"]["median"] > 0 and "ratio_vs_ideal" in report["configs"][config]
    assert report["configs"]["serial"]["busy_ms"]["comm"]["median"] == 0  # serial: everything on default
    assert report["targets"]["evaluated"] is False
    assert "targets not evaluated: the targets are for a GPU" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [(["--steps", "0"], "--steps must be >= 1, got 0"), (["--comm-ms", "-1"], "--comm-ms must be >= 0, got -1.0")],
)
def test_bench_gpu_rejects_bad_values(args, message):
    out = run([sys.executable, str(BENCH_GPU), "--device", "cpu", *args])
    assert out.returncode == 2 and message in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA; this one has one")
def test_bench_gpu_on_cuda_without_a_gpu_exits_2():
    out = run([sys.executable, str(BENCH_GPU), "--quick"])
    assert out.returncode == 2
    assert out.stderr == "bench_gpu: no CUDA device is visible; use --device cpu for the CPU smoke test\n"


# -- what the GPU machine runs imports only torch and the engine ------------------------------------


def test_bench_engine_without_plans_needs_only_torch():
    out = run_script_without_training_stack(BENCH_ENGINE, "--quick", "--no-plans")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["plans"] == {}
    assert set(report["targets"]["met"]) == {"sequential_us_per_task", "threaded_us_per_task", "overlap_ratio_vs_ideal"}


def test_training_tests_on_the_gpu_machine_need_no_torchrec(tmp_path):
    """tests/cuda/test_cuda_launcher.py and test_cuda_megatron.py where torchrec cannot be imported
    (as on the GPU machine, whose other packages are carried): they are collected and, here without
    CUDA, skip with the reason; their CPU counterparts run the same workers with torchrec blocked."""
    code = (
        "import sys\n"
        "sys.modules['torchrec'] = sys.modules['fbgemm_gpu'] = None\n"
        "import pytest\n"
        "sys.exit(pytest.main(['tests/cuda/test_cuda_launcher.py', 'tests/cuda/test_cuda_megatron.py', '-rs', "
        "'-p', 'no:cacheprovider']))\n"
    )
    out = run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout + out.stderr
    skipped = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    if torch.cuda.is_available():
        assert not skipped and " 2 passed" in out.stdout
    else:
        assert len(skipped) == 2 and all("no CUDA device is visible" in line for line in skipped), out.stdout
        assert "tests/test_dense_ddp.py runs the same worker on CPU" in out.stdout
        assert "tests/test_torch_only.py::test_launcher_plans_train_the_same_losses_without_torchrec" in out.stdout


@pytest.mark.parametrize("strict", [False, True])
def test_a_missing_package_skips_the_training_tests_or_fails_them_under_gpu_check(monkeypatch, strict):
    require_packages("torch", "json")  # present: nothing happens
    monkeypatch.setenv(STRICT_ENV, "1" if strict else "0")
    with pytest.raises(pytest.fail.Exception if strict else pytest.skip.Exception) as raised:
        require_packages("torch", "no_such_package_here")
    assert str(raised.value).startswith("needs no_such_package_here, which cannot be imported here")


def test_cuda_tests_collect_without_the_training_stack():
    """`pytest tests/cuda` on the GPU machine: the conftests and helpers import only torch, the
    engine, pytest and hypothesis, and nothing outside tests/cuda is collected."""
    code = WITHOUT_TRAINING_STACK + (
        "import pytest\n"
        "sys.exit(pytest.main(['tests/cuda', '--collect-only', '-q', '-p', 'no:cacheprovider',"
        " '-p', 'no:hydra_pytest']))\n"  # hydra's own pytest plugin: not installed on the GPU machine
    )
    out = run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout + out.stderr
    collected = [line for line in out.stdout.splitlines() if "::" in line]
    assert len(collected) > 50
    assert all(line.startswith("tests/cuda/") for line in collected)
