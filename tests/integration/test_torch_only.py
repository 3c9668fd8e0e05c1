"""A model with plain torch tables trains where torchrec (and fbgemm) cannot be imported: the
launcher, the task functions, the trainer and the data path import neither unless the model has
torchrec tables. Run in fresh interpreters in which importing them fails."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _launcher_runs import assert_runs_match_serial, run_launcher_worker

from recsys_pipe.testing import check_torchrun, run_torchrun, worker_env

BLOCK = """\
import sys
for name in ("torchrec", "fbgemm_gpu"):
    sys.modules[name] = None  # `import torchrec` now fails, as on a machine without it
"""
PLAN_AND_TRAIN = """\
from recsys_pipe.cli.train import main
assert "torchrec" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
main()
"""


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "train_without_torchrec.py"
    script.write_text(BLOCK + PLAN_AND_TRAIN)
    return script


def _metrics(root: Path) -> list[dict]:
    (path,) = root.glob("recsys-train/*/metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_imports_without_torchrec():
    code = BLOCK + textwrap.dedent(
        """\
        import recsys_pipe.data, recsys_pipe.models, recsys_pipe.train
        import recsys_pipe.train.tasks, recsys_pipe.train.state, recsys_pipe.train.trainer, recsys_pipe.train.build
        import recsys_pipe.data.batch, recsys_pipe.data.in_memory.criteo, recsys_pipe.models.dlrm, recsys_pipe.cli.train
        from recsys_pipe.train import Trainer, training_plan
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pipeline", ["serial", "hstu_prefetch"])
def test_plain_torch_dlrm_trains_without_torchrec(tmp_path, pipeline):
    proc = subprocess.run(
        [
            sys.executable,
            str(_script(tmp_path)),
            "model=dlrm_torch",
            "data=criteo_synthetic",
            f"pipeline={pipeline}",
            "trainer=smoke",
            f"trainer.output_dir={tmp_path}/runs",
        ],
        capture_output=True,
        text=True,
        timeout=250,
        env=worker_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _metrics(tmp_path / "runs")
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 9))
    assert records[-1]["step"] == 8 and "auc" in records[-1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plain_torch_dlrm_trains_on_two_ranks_without_torchrec(tmp_path):
    proc = run_torchrun(
        _script(tmp_path),
        "model=dlrm_torch",
        "pipeline=hstu_sparse_dist",
        "trainer=smoke",
        f"trainer.output_dir={tmp_path}/runs",
        timeout=250,
    )
    check_torchrun(proc)
    assert "plan hstu_sparse_dist | 2 rank(s)" in proc.stderr
    assert [r["step"] for r in _metrics(tmp_path / "runs") if "loss" in r] == list(range(1, 9))


def test_a_model_with_torchrec_tables_needs_it(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(_script(tmp_path)), "model=dlrm", "trainer=smoke", f"trainer.output_dir={tmp_path}/r"],
        capture_output=True,
        text=True,
        timeout=120,
        env=worker_env(),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        "error: model.name: model 'dlrm' has torchrec tables (a ShardedModelConfig), but torchrec cannot" in proc.stderr
    )
    assert "such as model=dlrm_torch, trains without it" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(300)
def test_launcher_plans_train_the_same_losses_without_torchrec(tmp_path):
    """The CPU counterpart of tests/cuda/test_cuda_launcher.py (same worker, torchrec blocked):
    serial, threaded and per-task-threaded plans train bitwise the same losses through
    `recsys-train`; megatron-core's DDP is refused on the CPU."""
    variants = ["serial", "hstu_sparse_dist", "hstu_prefetch/per_task", "megatron/serial"]
    report = run_launcher_worker(tmp_path, "cpu", variants, steps=8)
    assert list(report["variants"]) == variants
    assert_runs_match_serial(report, steps=8, placement="1 rank(s) on cpu (gloo)", refused=("megatron/serial",))
