"""The benchmarks package: `recsys-bench` (`python -m recsys_pipe.bench`) lists and dispatches the
benchmarks, and the engine benchmark runs through it and prints its final JSON line (figures are
not asserted here: timings belong to benchmark runs, not unit tests)."""

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from recsys_pipe.bench.engine import PINNING

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_bench_engine_quick_reports_every_measure():
    out = subprocess.run(
        [sys.executable, "-m", "recsys_pipe.bench", "engine", "--quick"],
        capture_output=True,
        cwd=ROOT,
        text=True,
        timeout=100,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) == {"machine", "sequential", "threaded", "scaling", "overlap", "plans", "targets"}
    assert set(report["scaling"]) == {f"{n}x{t}" for n in (1, 2, 4) for t in (10, 30, 100)}
    assert {key.split("/")[0] for key in report["plans"]} == {
        "serial",
        "sparse_dist",
        "hstu_sparse_dist",
        "hstu_prefetch",
    }
    assert report["plans"]["hstu_prefetch/hstu_default"]["us_per_step"]["median"] > 0
    if PINNING:  # threaded executors measured on one core too, side by side
        assert report["plans"]["hstu_prefetch/per_task"]["one_core"]["us_per_step"]["median"] > 0
        assert "one_core" not in report["plans"]["serial/sequential"]
    assert report["overlap"]["ratio_vs_ideal"]["median"] > 0
    assert report["machine"]["repeats"] == 2
    assert set(report["targets"]["met"]) >= {"sequential_us_per_task", "threaded_us_per_task", "overlap_ratio_vs_ideal"}
    assert "targets met:" in out.stdout


@pytest.mark.skipif(not PINNING, reason="this OS has no os.sched_setaffinity")
def test_on_one_core_pins_the_threads_a_run_starts_then_restores_the_caller():
    from recsys_pipe.bench.engine import on_one_core

    seen = []

    def run() -> float:
        worker = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        worker.start()
        worker.join()
        seen.append(os.sched_getaffinity(0))
        return 0.0

    before = os.sched_getaffinity(0)
    assert on_one_core(run)() == 0.0
    assert seen == [{min(before)}, {min(before)}]
    assert os.sched_getaffinity(0) == before


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "recsys_pipe.bench", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_recsys_bench_help_lists_every_benchmark():
    from recsys_pipe.bench import BENCHMARKS

    out = run_bench("--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: recsys-bench NAME")
    listed = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")]
    assert listed == list(BENCHMARKS)
    for name, bench in BENCHMARKS.items():  # every entry names a module of the package
        assert bench.module == f"recsys_pipe.bench.{name}"
        assert (ROOT / "recsys_pipe" / "bench" / f"{name}.py").is_file(), name


def test_recsys_bench_without_a_known_name_exits_2():
    out = run_bench()
    assert out.returncode == 2 and out.stderr.startswith("usage: recsys-bench NAME")
    out = run_bench("bogus", "--quick")
    assert out.returncode == 2
    assert out.stderr.startswith("recsys-bench: unknown benchmark 'bogus'; choose from engine, train,")


def test_recsys_bench_passes_arguments_to_the_benchmark():
    """A benchmark's own argument parser sees the arguments after the name (here its --help)."""
    out = run_bench("train", "--help")
    assert out.returncode == 0, out.stderr
    assert "--min-vs-class" in out.stdout and "--max-other-load" in out.stdout


def test_the_package_edits_no_import_path():
    """The benchmarks import the package as any module does: no `sys.path` edits, no E402 waivers."""
    for path in (ROOT / "recsys_pipe" / "bench").glob("*.py"):
        text = path.read_text()
        assert "sys.path" not in text, path.name
        assert "noqa: E402" not in text, path.name
    assert sorted(p.name for p in (ROOT / "scripts").iterdir() if p.suffix == ".py") == ["requirements.py"]


def test_the_package_loads_only_the_standard_library():
    """`recsys-bench --help` and the engine and GPU benchmarks run where torch is the only other
    package (the GPU machine): importing the package loads none of the training stack, nor torch."""
    code = (
        "import sys, recsys_pipe.bench as b\n"
        "for name in b.__all__: getattr(b, name)\n"
        "stack = ('torch', 'torchrec', 'fbgemm_gpu', 'hydra', 'omegaconf', 'pydantic', 'megatron')\n"
        "above = ('recsys_pipe.train', 'recsys_pipe.cli', 'recsys_pipe.models', 'recsys_pipe.data')\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in stack or m.startswith(above))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "", f"recsys_pipe.bench imported: {out.stdout.strip()}"


def test_nothing_below_the_benchmarks_imports_them():
    """Layering: the benchmarks sit at the CLI layer, above every other package; no module of
    another package imports them."""
    pattern = re.compile(r"^\s*(?:from|import)\s+recsys_pipe\.bench\b", re.M)
    package = ROOT / "recsys_pipe"
    importers = [
        str(path.relative_to(ROOT))
        for path in package.rglob("*.py")
        if package / "bench" not in path.parents and pattern.search(path.read_text())
    ]
    assert importers == []


def test_sasrec_loads_the_reference_model_by_path(tmp_path):
    """The reference's model.py is loaded from its file, not by adding its folder to the import path."""
    from recsys_pipe.bench.sasrec import reference_model_class

    (tmp_path / "model.py").write_text("class SASRec:\n    where = __file__\n")
    path_before = list(sys.path)
    cls = reference_model_class(str(tmp_path))
    assert cls.__name__ == "SASRec" and cls.where == str(tmp_path / "model.py")
    assert sys.path == path_before
    with pytest.raises(SystemExit, match="no model.py in"):
        reference_model_class(str(tmp_path / "missing"))


def test_sasrec_levers_off_put_back_torchs_stock_paths():
    """`--levers` measures each lever against torch's stock path: within `levers_off` the
    model's dropout draws `bernoulli_` masks and `optimizer=adam` runs the per-parameter loop;
    outside, the bit-threshold masks and the fused kernel."""
    import torch

    from recsys_pipe.bench.sasrec import levers_off
    from recsys_pipe.models.dropout import Dropout, DropoutRng
    from recsys_pipe.train.optim import AdamConfig

    x = torch.ones(4096)

    def drop() -> torch.Tensor:
        site = Dropout(0.5)
        DropoutRng(7).attach(site)
        return site(x)

    stock = x * torch.empty_like(x).bernoulli_(0.5, generator=torch.Generator().manual_seed(7)).div_(0.5)
    params = [torch.nn.Parameter(torch.zeros(2))]
    with levers_off(("mask", "fused_adam")):
        assert torch.equal(drop(), stock)
        assert not AdamConfig().build(params).defaults["fused"]
    assert not torch.equal(drop(), stock)
    assert AdamConfig().build(params).defaults["fused"]
    with levers_off(("fused_adam",)):
        assert not torch.equal(drop(), stock)


def test_recsys_bench_sasrec_runs_its_main():
    """`recsys-bench sasrec --help` reaches the benchmark's own parser (its `__main__` guard)."""
    out = run_bench("sasrec", "--help")
    assert out.returncode == 0, out.stderr
    assert "--levers" in out.stdout and "--reference" in out.stdout
