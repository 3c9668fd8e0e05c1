"""`trainer.dense_ddp` on a machine without a GPU.

* The refusals: megatron on the CPU and megatron with torchrec-sharded tables exit 2 in both
  CLIs, naming `trainer.dense_ddp` and why, before any process group starts; so does
  `build_model` for programmatic use; a missing megatron-core is refused the same way.
* The real megatron-core code on the CPU: its DDP allocates the gradient buffers on
  `torch.cuda.current_device()`, which the worker points at the CPU (nothing else is replaced), so
  megatron-core's DDP, buffers, backward hooks and finalize_model_grads train here on gloo through
  the real state and task functions, and must give torch DDP's losses, gradients and parameters
  bitwise on one rank and on two. tests/cuda/test_cuda_megatron.py runs the same worker on a GPU.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dense_ddp import assert_megatron_matches_torch, run_worker

from recsys_pipe.cli.plan import run as plan_cli
from recsys_pipe.cli.train import run as train_run
from recsys_pipe.config import ConfigError
from recsys_pipe.runtime import DistInfo
from recsys_pipe.testing import load_run, worker_env
from recsys_pipe.train import build_model

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CPU_REFUSAL = (
    "error: trainer.dense_ddp: megatron needs CUDA: megatron-core's DistributedDataParallel keeps its gradient "
    "buffers on the GPU, and this run trains on the CPU ({where}); use trainer.dense_ddp=torch"
)
SHARDED_REFUSAL = (
    "error: trainer.dense_ddp: megatron wraps models with plain torch tables (such as model=dlrm_torch); model "
    "'dlrm' has torchrec-sharded tables, whose dense part DistributedModelParallel wraps in torch DDP: "
    "megatron-core's DDP cannot leave the sharded tables' parameters out, so this is not supported; use "
    "trainer.dense_ddp=torch"
)
NO_CUDA = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the answer where no CUDA device is visible; this machine has one"
)


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


# -- the refusals ----------------------------------------------------------------------------------


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "device, where",
    [
        ("cpu", "trainer.device=cpu"),
        pytest.param("auto", "trainer.device=auto and no CUDA device is visible", marks=NO_CUDA),
    ],
)
def test_recsys_train_refuses_megatron_on_the_cpu(tmp_path, device, where, capsys, no_process_group):
    code = train_run(["model=dlrm_torch", "trainer.dense_ddp=megatron", f"trainer.device={device}", *out(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert error_lines(err) == [CPU_REFUSAL.format(where=where)]
    assert "Traceback" not in err and "nothing was started" in err
    assert not (tmp_path / "runs").exists()  # refused before the process group and the run directory


@pytest.mark.timeout(200)
def test_recsys_train_refuses_megatron_for_torchrec_sharded_tables(tmp_path, capsys, no_process_group):
    code = train_run(["model=dlrm", "trainer.dense_ddp=megatron", "trainer.device=cpu", *out(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert error_lines(err) == [SHARDED_REFUSAL, CPU_REFUSAL.format(where="trainer.device=cpu")]
    assert not (tmp_path / "runs").exists()


def out(tmp_path):
    """Where the run directory would go."""
    return [f"trainer.output_dir={tmp_path}/runs"]


@pytest.mark.parametrize(
    "overrides, errors",
    [
        (["model=dlrm_torch", "trainer.device=cpu"], [CPU_REFUSAL.format(where="trainer.device=cpu")]),
        (["model=dlrm", "trainer.device=cuda"], [SHARDED_REFUSAL]),
        pytest.param(
            ["model=dlrm_torch"],
            [CPU_REFUSAL.format(where="trainer.device=auto and no CUDA device is visible")],
            marks=NO_CUDA,
        ),
    ],
)
def test_recsys_plan_refuses_what_recsys_train_refuses(tmp_path, capsys, overrides, errors):
    assert plan_cli([*overrides, "trainer.dense_ddp=megatron", f"hydra.run.dir={tmp_path}"]) == 2
    assert error_lines(capsys.readouterr().err) == errors


def test_recsys_plan_shows_a_megatron_plan_for_cuda(tmp_path, capsys):
    """A plan for a CUDA run can be shown on a machine without one (as for sharding plans): the
    model line says megatron-core's DDP, and finalize_model_grads is not idle any more."""
    common = ["model=dlrm_torch", "pipeline=serial", "trainer.device=cuda", f"hydra.run.dir={tmp_path}"]
    assert plan_cli([*common, "trainer.dense_ddp=megatron"]) == 0
    out = capsys.readouterr().out
    assert (
        "model: dlrm_torch (plain torch tables, replicated on every rank under megatron-core's DDP; gradients "
        "all-reduced by finalize_model_grads)" in out
    )
    assert "  finalize_model_grads:" not in out
    assert plan_cli(common) == 0
    out = capsys.readouterr().out
    assert "model: dlrm_torch (plain torch tables, replicated on every rank under DDP)" in out
    assert (
        "  finalize_model_grads: torch DDP all-reduces the gradients during backward (trainer.dense_ddp=megatron "
        "uses it)" in out
    )


@pytest.mark.timeout(200)
def test_a_missing_megatron_core_is_a_config_error(tmp_path):
    """Where megatron-core is not installed (the CUDA check passes: a plan for cuda)."""
    block = "import sys\nsys.modules['megatron'] = None\n"
    script = block + "from recsys_pipe.cli.plan import main\nmain()\n"
    proc = subprocess.run(
        [sys.executable, "-c", script, "model=dlrm_torch", "trainer.device=cuda", "trainer.dense_ddp=megatron"]
        + [f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=150,
        env=worker_env(),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    assert line.startswith("error: trainer.dense_ddp: megatron-core cannot be imported here (")
    assert line.endswith("); install megatron-core (0.16.1 is tested) or use trainer.dense_ddp=torch")


def test_build_model_refuses_megatron_on_the_cpu():
    """The programmatic path (Trainer, build_model) refuses as the CLIs do, before building anything."""
    run = load_run("model=dlrm_torch", "trainer.dense_ddp=megatron", "trainer.device=cpu")
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ConfigError) as raised:
        build_model(run, info, run.data.spec())
    assert [p.path for p in raised.value.problems] == ["trainer.dense_ddp"]


def test_torch_is_the_default():
    assert load_run("model=dlrm_torch").trainer.dense_ddp == "torch"
    assert load_run("model=dlrm_torch", "trainer=smoke").trainer.dense_ddp == "torch"


# -- megatron-core's DDP for real, on the CPU --------------------------------------------------------


@pytest.mark.timeout(300)
def test_megatron_ddp_trains_like_torch_ddp_bitwise_on_one_rank(tmp_path):
    assert_megatron_matches_torch(run_worker(tmp_path, "cpu"), "cpu")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_megatron_ddp_trains_like_torch_ddp_bitwise_on_two_ranks(tmp_path):
    """Two ranks on gloo: megatron-core's all-reduce of its buffer really reduces something."""
    assert_megatron_matches_torch(run_worker(tmp_path, "cpu", nproc=2), "cpu")


LIFETIME = """
import os, torch, torch.distributed as dist
torch.cuda.current_device = lambda: torch.device("cpu")  # megatron-core's buffer device (see the module docstring)
from megatron.core import parallel_state
from recsys_pipe.train import MegatronGrads, megatron_ddp
from recsys_pipe.runtime import init_distributed

init_distributed("cpu")
initialized = parallel_state.model_parallel_is_initialized
first, second = megatron_ddp(torch.nn.Linear(2, 2)), megatron_ddp(torch.nn.Linear(2, 2))
assert initialized() and parallel_state.get_data_parallel_world_size() == 1
MegatronGrads(first).close()
assert initialized(), "closing one model must leave the state the other uses"
grads = MegatronGrads(second)
grads.close()
assert not initialized(), "the last close destroys what megatron_ddp initialized"
grads.close()  # gives back once only: else the next model would count on a state nobody initialized
third = MegatronGrads(megatron_ddp(torch.nn.Linear(2, 2)))
assert initialized()
third.close()
assert not initialized()
parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)  # someone else's
MegatronGrads(megatron_ddp(torch.nn.Linear(2, 2))).close()
assert initialized(), "state initialized elsewhere is left alone"
print("ok")
"""


@pytest.mark.timeout(200)
def test_parallel_state_lives_as_long_as_the_megatron_models():
    proc = subprocess.run(
        [sys.executable, "-c", LIFETIME],
        capture_output=True,
        text=True,
        timeout=150,
        env=worker_env(),
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]
