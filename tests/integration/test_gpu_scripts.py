"""The GPU scripts on a machine without a GPU: argument handling, the "no CUDA" answer, the order of
gpu_check.sh's steps and its summary, the staged runs that bring fbgemm-gpu in pieces (with small
fake pieces), the time budget and --resume, the GPU benchmark's plan on CPU, and that what runs on the
GPU machine imports nothing of the training stack (which is not installed there)."""

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from _launcher_runs import STRICT_ENV, require_packages

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"
GPU_WHEELS = ROOT / "scripts" / "gpu_wheels.sh"
BENCH_GPU = "recsys_pipe.bench.gpu"
BENCH_ENGINE = "recsys_pipe.bench.engine"

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


def run_module_without_training_stack(module, *args):
    code = WITHOUT_TRAINING_STACK + f"import runpy; sys.argv = [{module!r}, *{list(args)!r}]\n"
    code += f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    return run([sys.executable, "-c", code])


# -- gpu_check.sh ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "unknown argument '--bogus'"),
        (["--out"], "--out needs a value"),
        (["--wheels", "/nonexistent/wheels"], "--wheels /nonexistent/wheels is not a directory"),
        (["--python", "/nonexistent/python"], "python '/nonexistent/python' not found"),
        (["--budget", "59"], "--budget must be a whole number of seconds >= 60, got '59'"),
        (["--stage", "0"], "--stage must be a piece number from 1 to 99, got '0'"),
        (["--stage", "two"], "--stage must be a piece number from 1 to 99, got 'two'"),
        (["--stage", "3", "--resume"], "--stage and --resume exclude each other"),
        (["--assemble-only"], "--assemble-only needs --stage"),
        (
            ["--stage", "2", "--pieces", "/nonexistent"],
            "--stage 2: no piece /nonexistent/fb.part01 here (bring it with this run)",
        ),
    ],
)
def test_gpu_check_bad_arguments_exit_2_with_one_line(args, message):
    out = run(["bash", str(GPU_CHECK), *args])
    assert out.returncode == 2
    assert out.stderr == f"gpu_check: {message} (see --help)\n"


def test_gpu_check_steps_must_be_known():
    out = run(["bash", str(GPU_CHECK), "--steps", "cuda_tests,bogus"])
    assert out.returncode == 2
    assert out.stderr.startswith("gpu_check: --steps: unknown step 'bogus' (steps: cuda_tests,launcher_cuda,")


def test_gpu_check_steps_runs_only_those(tmp_path):
    """`--steps` (the documented runs of a short GPU session pick their steps): only the named
    steps run and are summarised; the steps are stubs here, this is the selection."""
    stub, env = gpu_machine(tmp_path, stub_steps=True)
    out_dir = tmp_path / "out"
    out = run(
        [
            "bash",
            str(GPU_CHECK),
            "--python",
            str(stub),
            "--steps",
            "engine_costs,bench_attention",
            "--out",
            str(out_dir),
        ],
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows, overall = summary_rows(out_dir)
    assert list(rows) == ["engine_costs", "bench_attention", "torchrec"] and overall == "overall: PASSED"
    assert (
        "stub: -m recsys_pipe.bench.hstu_gpu --only attention --shapes e2e_1024,e2e,dlrmv4"
        in packed_logs(out_dir)["bench_attention.log"]
    )


def test_gpu_check_help():
    out = run(["bash", str(GPU_CHECK), "--help"])
    assert out.returncode == 0 and out.stdout.startswith("usage: scripts/gpu_check.sh")


def test_gpu_check_without_a_gpu_says_so_and_runs_nothing(tmp_path):
    out = run(["bash", str(GPU_CHECK), "--python", sys.executable, "--out", str(tmp_path / "out")])
    assert out.returncode == 3
    assert "gpu_check: no CUDA GPU is visible to" in out.stderr and "nothing was run" in out.stderr
    assert not (tmp_path / "out").exists()


def gpu_machine(tmp_path, sleep_in_cuda_tests=0, stub_steps=False):
    """An interpreter that answers the GPU probe as a GPU machine would and is the real one
    otherwise, and the environment that makes the training stack unimportable (a `sitecustomize`).
    `sleep_in_cuda_tests`: the cuda_tests step only sleeps that long; `stub_steps`: every step
    (pytest, the benchmarks) only says it ran, for tests of the sequencing alone."""
    tmp_path.mkdir(exist_ok=True)
    fake = tmp_path / "python"
    stubs = ""
    if sleep_in_cuda_tests:
        stubs += f'if [[ "$*" == *"pytest tests/cuda -q"* ]]; then sleep {sleep_in_cuda_tests}; exit 0; fi\n'
    if stub_steps:
        stubs += 'if [[ "$*" == *"-m pytest"* || "$*" == *"recsys_pipe.bench."* ]]; then echo "stub: $*"; exit 0; fi\n'
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$*" == *"torch.cuda.is_available()"* && "$*" == *\'sep="|"\'* ]]; then\n'
        '  echo "2.11.0+cu130|13.0|True"; exit 0\n'
        "fi\n" + stubs + f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    (tmp_path / "sitecustomize").mkdir()
    (tmp_path / "sitecustomize" / "sitecustomize.py").write_text(WITHOUT_TRAINING_STACK)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "sitecustomize"), "PYTEST_ADDOPTS": "-p no:hydra_pytest"}
    return fake, env


def packed_logs(out_dir):
    """The step logs, name -> text, from `logs.tgz` (where gpu_check.sh packs them at the end)."""
    with tarfile.open(out_dir / "logs.tgz") as archive:
        return {Path(m.name).name: archive.extractfile(m).read().decode() for m in archive.getmembers() if m.isfile()}


def summary_rows(out_dir):
    summary = (out_dir / "summary.txt").read_text().splitlines()
    return {line.split()[0]: line for line in summary[2:-1]}, summary[-1]


@pytest.mark.timeout(450)  # five steps of real work, slow on a shared 2-core machine
def test_gpu_check_runs_every_step_and_summarises(tmp_path):
    """The whole sequence as on the GPU machine (see `gpu_machine`): tests/cuda (the engine's, the
    launcher's, megatron's) are collected and skip, the GPU benchmark finds no CUDA and fails,
    the engine benchmark runs without the shipped plans, torchrec's steps are not run (no torchrec and
    no staged site) and the summary says so; the check fails."""
    fake, env = gpu_machine(tmp_path)
    (tmp_path / "no_wheels").mkdir()
    out_dir = tmp_path / "out"
    out = run(
        ["bash", str(GPU_CHECK), "--python", str(fake), "--quick", "--out", str(out_dir)]
        + ["--wheels", str(tmp_path / "no_wheels")],
        timeout=400,
        env=env,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    rows, overall = summary_rows(out_dir)
    assert list(rows) == [
        "cuda_tests",
        "launcher_cuda",
        "megatron_cuda",
        "bench_gpu",
        "bench_engine",
        "engine_costs",
        "bench_attention",
        "torchrec",
    ]
    assert " passed " in rows["cuda_tests"] and " skipped" in rows["cuda_tests"]
    assert "1 skipped" in rows["launcher_cuda"] and "1 skipped" in rows["megatron_cuda"]
    logs = packed_logs(out_dir)
    log = logs["cuda_tests.log"]
    assert "test_cuda_launcher" not in log and "test_cuda_torchrec" not in log  # each test in one step only
    assert "failed (exit 2)" in rows["bench_gpu"] and "no report" in rows["bench_gpu"]
    assert " passed " in rows["bench_engine"] and "µs/task" in rows["bench_engine"]
    assert "shipped plans skipped: ImportError: " in rows["bench_engine"]
    assert " passed " in rows["engine_costs"] and "stream_entry" in rows["engine_costs"]
    # the attention alone needs torch and triton only (interpreted here): padded against triton
    assert " passed " in rows["bench_attention"] and "quick: triton_vs_padded " in rows["bench_attention"]
    assert "not run" in rows["torchrec"] and "torchrec is not importable here" in rows["torchrec"]
    assert overall == "overall: FAILED"
    assert out.stdout.rstrip().endswith("overall: FAILED")
    assert json.loads((out_dir / "bench_engine.json").read_text())["plans"] == {}
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "bench_attention.json",
        "bench_engine.json",
        "engine_costs.json",
        "logs.tgz",
        "summary.txt",
    ]
    assert sorted(logs) == [
        "bench_attention.log",
        "bench_engine.log",
        "bench_gpu.log",
        "cuda_tests.log",
        "engine_costs.log",
        "launcher_cuda.log",
        "megatron_cuda.log",
    ]


# -- gpu_check.sh --stage: fbgemm-gpu in pieces, one per run ----------------------------------------


def tiny_wheel(directory, name="tinypkg"):
    """A pure-Python wheel with one module, as the small wheels are."""
    path = directory / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    files = {
        f"{name}/__init__.py": "ANSWER = 42\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as whl:
        for n, text in {**files, f"{info}/RECORD": record}.items():
            whl.writestr(n, text)
    return path


def fake_pieces(tmp_path, pieces=3):
    """A small stand-in for the repacked fbgemm-gpu, as scripts/gpu_wheels.sh leaves it: a tar.xz of
    a site-packages layout (a `fbgemm_gpu` package, a 200 kB library file) split into `pieces`
    pieces, each in its own folder as each run brings only its own; the small wheels and the
    checksums in `small/`. Returns (piece folders, small folder)."""
    payload = io.BytesIO()
    members = {
        "./fbgemm_gpu/__init__.py": b"VERSION = 'staged'\n",
        "./fbgemm_gpu/fbgemm_gpu_py.so": os.urandom(200_000),  # incompressible: every piece has bytes
        "./fbgemm_gpu-1.6.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: fbgemm_gpu\nVersion: 1.6.0\n",
    }
    with tarfile.open(fileobj=payload, mode="w|xz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    data = payload.getvalue()
    size = -(-len(data) // pieces)
    small = tmp_path / "small"
    small.mkdir()
    tiny_wheel(small)
    folders, manifest = [], []
    for i in range(pieces):
        folder = tmp_path / f"run{i + 1}"
        folder.mkdir()
        chunk = data[i * size : (i + 1) * size]
        (folder / f"fb.part{i:02d}").write_bytes(chunk)
        manifest.append(f"{hashlib.sha256(chunk).hexdigest()}  fb.part{i:02d}\n")
        folders.append(folder)
    (small / "fbgemm_gpu.sha256").write_text("".join(manifest))
    return folders, small, members


def stage(n, pieces_dir, stage_dir, wheels, *extra, env=None):
    return run(
        ["bash", str(GPU_CHECK), "--python", sys.executable, "--stage", str(n), "--pieces", str(pieces_dir)]
        + ["--stage-dir", str(stage_dir), "--wheels", str(wheels), *extra],
        env=env,
    )


def test_three_stage_runs_assemble_the_site_from_the_pieces(tmp_path):
    folders, small, members = fake_pieces(tmp_path)
    stage_dir, nothing = tmp_path / "stage", tmp_path / "nothing"
    nothing.mkdir()
    (stage_dir / "leftover").mkdir(parents=True)  # an earlier set: --stage 1 starts afresh
    out = stage(1, folders[0], stage_dir, nothing)
    assert out.returncode == 0, out.stderr
    assert "fb.part00" in out.stdout and "next: --stage 2 with fb.part01" in out.stdout  # the ls, the advice
    assert sorted(p.name for p in stage_dir.iterdir()) == ["fb.part00"]
    out = stage(2, folders[1], stage_dir, nothing)
    assert out.returncode == 0 and "next: --stage 3 with fb.part02" in out.stdout, out.stderr
    first = tmp_path / "first"  # the torch-only wheels the first run brought; the checksums come with the last
    first.mkdir()
    tiny_wheel(first, "firstpkg")
    out = stage(3, folders[2], stage_dir, first, "--wheels", str(small), "--assemble-only")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all 3 pieces staged and intact" in out.stdout and "2 wheel(s)" in out.stdout
    site = stage_dir / "site"
    for name, data in members.items():
        assert (site / name).read_bytes() == data
    assert (site / ".recsys_pipe_site_ready").exists()
    code = "import fbgemm_gpu, tinypkg, firstpkg; print(fbgemm_gpu.VERSION, tinypkg.ANSWER, firstpkg.ANSWER)"
    imported = run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(site)})
    assert imported.stdout == "staged 42 42\n", imported.stderr


def test_the_last_stage_goes_on_to_the_gpu_steps(tmp_path):
    """Without --assemble-only the run that completes the set goes on to the GPU check (here: no
    GPU, exit 3 after assembling)."""
    folders, small, _ = fake_pieces(tmp_path, pieces=2)
    stage_dir = tmp_path / "stage"
    assert stage(1, folders[0], stage_dir, tmp_path / "run1").returncode == 0
    out = stage(2, folders[1], stage_dir, small, "--out", str(tmp_path / "out"))
    assert out.returncode == 3 and "no CUDA GPU is visible" in out.stderr, out.stdout + out.stderr
    assert (stage_dir / "site" / "fbgemm_gpu" / "__init__.py").exists()


def test_missing_or_corrupt_pieces_say_start_again_exit_4(tmp_path):
    folders, small, _ = fake_pieces(tmp_path)
    stage_dir = tmp_path / "stage"
    out = stage(3, folders[2], stage_dir, small, "--assemble-only")  # the machine forgot runs 1 and 2
    assert out.returncode == 4
    assert "pieces missing from" in out.stderr and "fb.part00 fb.part01" in out.stderr
    assert out.stderr.endswith("start again with --stage 1 (docs/gpu.md)\n")
    assert not (stage_dir / "site").exists()
    (folders[1] / "fb.part01").write_bytes(b"corrupted")
    for n in (1, 2):
        assert stage(n, folders[n - 1], stage_dir, tmp_path / "run1").returncode == 0
    out = stage(3, folders[2], stage_dir, small, "--assemble-only")
    assert out.returncode == 4 and "does not match" in out.stderr
    assert not (stage_dir / "site").exists()
    out = run(["bash", str(GPU_CHECK), "--python", sys.executable, "--resume", "--stage-dir", str(stage_dir)])
    assert out.returncode == 4 and "no assembled site in" in out.stderr


@pytest.mark.timeout(600)  # two gpu_check runs, the first 20 s by design
def test_budget_leaves_steps_for_resume_which_runs_only_those(tmp_path):
    """A staged run whose first step (16 s here) leaves less of --budget (60 s, 15 kept for the
    summary) than a step's 30 s minimum leaves the rest for --resume (whatever the start-up
    took, as long as the first step still got its 30 s); --resume runs them (not the
    one that passed) with the staged site and summarises all; torchrec's steps fail there, as this
    staged site does not bring torchrec. The steps themselves are stubs: this is the sequencing."""
    folders, small, _ = fake_pieces(tmp_path, pieces=1)
    stage_dir = tmp_path / "stage"
    assert stage(1, folders[0], stage_dir, small, "--assemble-only").returncode == 0
    slow, env = gpu_machine(tmp_path / "slow", sleep_in_cuda_tests=16)
    common = ["--quick", "--stage-dir", str(stage_dir), "--wheels", str(small)]
    first = tmp_path / "first"
    out = run(
        ["bash", str(GPU_CHECK), "--python", str(slow), "--resume", "--budget", "60", "--out", str(first), *common],
        env=env,
        timeout=280,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    rows, overall = summary_rows(first)
    assert " passed " in rows["cuda_tests"]
    for name in ("launcher_cuda", "megatron_cuda", "bench_gpu", "bench_engine", "engine_costs", "bench_attention"):
        assert "left for --resume" in rows[name], rows[name]
    assert overall.startswith("overall: INCOMPLETE: launcher_cuda, megatron_cuda") and "--resume" in overall
    assert not (first / "cuda_tests.log").exists()  # packed; --resume brings it from the stage folder
    stub, env = gpu_machine(tmp_path / "stub", stub_steps=True)
    second = tmp_path / "second"
    out = run(
        ["bash", str(GPU_CHECK), "--python", str(stub), "--resume", "--out", str(second), *common], env=env, timeout=280
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[gpu_check] cuda_tests: passed in an earlier run" in out.stdout
    assert "[gpu_check] launcher_cuda: passed in" in out.stdout and "[gpu_check] bench_engine: passed in" in out.stdout
    rows, overall = summary_rows(second)
    assert list(rows) == [
        "cuda_tests",
        "launcher_cuda",
        "megatron_cuda",
        "bench_gpu",
        "bench_engine",
        "engine_costs",
        "bench_attention",
        "torchrec_cuda",
        "host_step",
        "bench_hstu_step",
        "bench_train",
        "torch_profile",
    ]
    for name in ("cuda_tests", "launcher_cuda", "megatron_cuda", "bench_gpu", "bench_engine", "engine_costs"):
        assert " passed " in rows[name], rows[name]
    assert "stub: -m pytest tests/cuda/test_cuda_launcher.py" in rows["launcher_cuda"]
    for name in ("torchrec_cuda", "host_step", "bench_hstu_step", "bench_train", "torch_profile"):
        assert "failed (no torchrec)" in rows[name] and "torchrec does not import from the staged site" in rows[name]
    assert overall == "overall: FAILED"
    assert "cuda_tests.log" in packed_logs(second)


def test_gpu_wheels_arguments():
    """(Downloading needs a package index: checked by hand, docs/gpu.md.)"""
    out = run(["bash", str(GPU_WHEELS), "--help"])
    assert (
        out.returncode == 0
        and "bash scripts/gpu_wheels.sh [--dir DIR] [--no-fbgemm] [--gr CLONE] [REQUIREMENT ...]" in out.stdout
    )
    assert "set -euo" not in out.stdout  # the help is the comment block, nothing after it
    bad = run(["bash", str(GPU_WHEELS), "--gr", "/nonexistent"])
    assert bad.returncode == 2 and bad.stderr == "gpu_wheels: --gr needs a generative-recommenders clone\n"
    out = run(["bash", str(GPU_WHEELS), "--bogus"])
    assert out.returncode == 2 and out.stderr == "gpu_wheels: unknown option '--bogus' (see --help)\n"
    out = run(["bash", str(GPU_WHEELS), "--dir"])
    assert out.returncode == 2 and out.stderr == "gpu_wheels: --dir needs a directory\n"


# -- recsys_pipe.bench.gpu ----------------------------------------------------------------------------


def test_bench_gpu_cpu_smoke_trains_every_configuration_like_serial():
    out = run_module_without_training_stack(BENCH_GPU, "--device", "cpu", "--quick")
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
    assert list(report["configs"]) == ["serial", "lookahead_sequential", "lookahead_threaded"]
    assert report["numerics"]["losses_bitwise_equal_to_serial"] == {
        "lookahead_sequential": True,
        "lookahead_threaded": True,
    }
    for config in ("lookahead_sequential", "lookahead_threaded"):
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
    out = run([sys.executable, "-m", BENCH_GPU, "--device", "cpu", *args])
    assert out.returncode == 2 and message in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA; this one has one")
def test_bench_gpu_on_cuda_without_a_gpu_exits_2():
    out = run([sys.executable, "-m", BENCH_GPU, "--quick"])
    assert out.returncode == 2
    assert out.stderr == "bench_gpu: no CUDA device is visible; use --device cpu for the CPU smoke test\n"


# -- what the GPU machine runs imports only torch and the engine ------------------------------------


def test_bench_engine_without_plans_needs_only_torch():
    out = run_module_without_training_stack(BENCH_ENGINE, "--quick", "--no-plans")
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
        assert "tests/integration/test_dense_ddp.py runs the same worker on CPU" in out.stdout
        counterpart = "tests/integration/test_torch_only.py::test_launcher_plans_train_the_same_losses_without_torchrec"
        assert counterpart in out.stdout


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
