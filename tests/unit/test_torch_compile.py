"""`trainer.compile=true`: the dense modules compiled under every plan, in one process.

Tolerances. Compiled by `aot_eager` (torch.compile's graph capture and autograd, no code
generation) a plan trains bitwise the eager plan's losses, and every plan that trains the same
numbers eagerly (serial, sparse_dist, hstu_prefetch) trains the same bits compiled; semi_sync
(stale embeddings) equals its own eager run. Compiled by `inductor` (fused kernels: other
rounding), serial and the plans with lookaheads still train bitwise the same as each other, and stay
within rtol=1e-5, atol=1e-6 of eager over the steps here (the 200-step comparison is
`recsys-bench compile`; docs/training.md states both).
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch
from _process_group import one_rank_group

from recsys_pipe.cli import train as train_cli
from recsys_pipe.testing import built_trainer, load_run
from recsys_pipe.train.torch_compile import CompileOptions

STEPS = 5
#: the default model (hstu_small) with dropout, so masks are drawn between compiled graphs
COMMON = [
    "trainer=smoke",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every=100",
    "trainer.tensorboard=false",
    "trainer.eval_every=0",
    "model.dropout=0.3",
    "data.batch_size=8",
    "data.num_batches=8",
]
AOT = ["trainer.compile=true", "trainer.compile_options.backend=aot_eager"]
PLANS = ["serial", "sparse_dist", "hstu_prefetch", "semi_sync"]


@pytest.fixture
def info():
    """A 1-rank process group for one test."""
    with one_rank_group() as info:
        yield info


def _fit(info, *overrides: str) -> tuple[list[float], dict]:
    """Per-step losses, and what the run compiled with its state_dict keys."""
    with built_trainer(info, overrides) as trainer:
        losses = trainer.fit(record_steps=True).losses
        compiled = trainer.parts.compiled
        return losses, {
            "stats": compiled.stats() if compiled else None,
            "keys": list(trainer.state.model.state_dict()),
        }


def test_the_options_default_to_torch_compiles_own():
    defaults = {k: p.default for k, p in inspect.signature(torch.compile).parameters.items()}
    kwargs = CompileOptions().compile_kwargs()
    assert kwargs == {k: defaults[k] for k in kwargs}
    assert load_run().trainer.compile is False


@pytest.mark.timeout(300)
def test_compiled_plans_train_the_eager_bits_and_the_same_as_each_other(info):
    eager = {plan: _fit(info, f"pipeline={plan}", *COMMON) for plan in ("serial", "semi_sync")}
    for plan in PLANS:
        losses, compiled = _fit(info, f"pipeline={plan}", *COMMON, *AOT)
        assert len(losses) == STEPS
        assert losses == eager["semi_sync" if plan == "semi_sync" else "serial"][0], plan
        stats = compiled["stats"]
        assert stats.graphs > 0 and stats.graph_breaks > 0 and stats.seconds > 0, (plan, stats)
        assert compiled["keys"] == eager["serial"][1]["keys"], plan  # checkpoints keep their keys
    assert eager["semi_sync"][0] != eager["serial"][0]  # the semi_sync comparison is not serial's


@pytest.fixture(scope="module")
def sequences(tmp_path_factory) -> list[str]:
    """`data=sequences` overrides for a small "user item" file."""
    g = torch.Generator().manual_seed(0)
    lines = []
    for u in range(1, 41):
        n = int(torch.randint(3, 12, (1,), generator=g))
        start = int(torch.randint(0, 30, (1,), generator=g))
        lines += [f"{u} {(start + k) % 30 + 100}" for k in range(n)]
    path = tmp_path_factory.mktemp("seq") / "seq.txt"
    path.write_text("\n".join(lines) + "\n")
    return ["data=sequences", f"data.path={path}", "data.batch_size=8", "data.eval_negatives=5"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["dlrm", "dlrm_dcn", "dlrm_torch", "sasrec", "hstu_retrieval"])
def test_every_other_model_compiles_its_dense_modules(info, sequences, model):
    data = sequences if model in ("sasrec", "hstu_retrieval") else ["data.batch_size=8", "data.num_batches=8"]
    common = ["pipeline=hstu_prefetch", *COMMON[:5], "trainer.max_steps=3", f"model={model}", *data]
    eager, _ = _fit(info, *common)
    losses, compiled = _fit(info, *common, *AOT)
    assert losses == eager
    assert compiled["stats"].graphs > 0


@pytest.mark.timeout(300)
def test_inductor_trains_the_same_bits_under_every_plan_close_to_eager(info):
    eager, _ = _fit(info, "pipeline=serial", *COMMON)
    inductor = ["trainer.compile=true"]  # the default backend
    serial, compiled = _fit(info, "pipeline=serial", *COMMON, *inductor)
    prefetch, _ = _fit(info, "pipeline=hstu_prefetch", *COMMON, *inductor)
    assert prefetch == serial
    torch.testing.assert_close(torch.tensor(serial), torch.tensor(eager), rtol=1e-5, atol=1e-6)
    assert compiled["stats"].graphs > 0


def test_a_compile_failure_becomes_a_config_error_naming_the_key_and_nothing_else_does():
    from torch._dynamo.exc import BackendCompilerFailed, Unsupported

    from recsys_pipe.config import ConfigError
    from recsys_pipe.engine import TaskFailedError
    from recsys_pipe.train.torch_compile import CompiledDense, compile_failures

    def failing(cause: Exception) -> None:
        try:
            raise cause
        except Exception as exc:
            raise TaskFailedError("forward", 3, 3) from exc

    compiled = CompiledDense([], CompileOptions(fullgraph=True))
    try:
        with pytest.raises(ConfigError) as info, compile_failures(compiled):
            failing(BackendCompilerFailed(lambda: None, RuntimeError("no C++ compiler"), None))
        ((path, message),) = [(p.path, p.message) for p in info.value.problems]
        assert path == "trainer.compile" and "(RuntimeError: no C++ compiler)" in message
        with pytest.raises(ConfigError) as info, compile_failures(compiled):
            failing(Unsupported("graph break"))
        assert [p.path for p in info.value.problems] == ["trainer.compile_options.fullgraph"]
        with pytest.raises(TaskFailedError), compile_failures(compiled):
            failing(RuntimeError("not the compiler's"))
    finally:
        compiled.close()
    with pytest.raises(TaskFailedError), compile_failures(None):
        failing(Unsupported("graph break"))


def test_deterministic_algorithms_are_on_while_compiled_and_restored_after():
    from recsys_pipe.train.torch_compile import CompiledDense

    assert not torch.are_deterministic_algorithms_enabled()
    compiled = CompiledDense([], CompileOptions())
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    compiled.close()
    compiled.close()  # twice is fine
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory
    CompiledDense([], CompileOptions(deterministic=False)).close()
    assert not torch.are_deterministic_algorithms_enabled()


# -- the CLI: counts in the log and metrics.jsonl, exit 2 naming the key ---------------------------


@pytest.fixture
def cli_group():
    """`recsys-train` in-process makes its own 1-rank group: torn down afterwards."""
    with one_rank_group(start=False):
        yield


@pytest.mark.timeout(300)
def test_compile_time_graph_breaks_and_recompiles_go_to_the_log_and_metrics(tmp_path, cli_group):
    argv = ["pipeline=hstu_prefetch", *COMMON, *AOT, "trainer.log_every=2", f"trainer.output_dir={tmp_path}"]
    assert train_cli.run(argv) == 0
    (metrics,) = tmp_path.glob("recsys-train/*/metrics.jsonl")
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        assert record["compile_s"] > 0 and record["compile_graphs"] > 0 and record["compile_graph_breaks"] > 0
    assert records[-1]["compile_recompiles"] > 0  # the first change of a sequence length recompiles
    log = (metrics.parent / "train.log").read_text()
    assert "step 2 | torch.compile: " in log and " graph breaks, " in log and " recompiles" in log
    summary = next(line for line in log.splitlines() if f"trained {STEPS} steps" in line)
    assert re.search(r"; torch\.compile: \d+\.\d s compiling \(left out of samples/s\), [1-9]\d* graphs, ", summary)


def test_the_summary_leaves_compile_time_out_of_samples_per_s():
    """As the step lines do: 1000 samples in 10 s of which 8 s compiling is 500 samples/s."""
    from recsys_pipe.train.torch_compile import CompileStats
    from recsys_pipe.train.trainer import TrainSummary

    summary = TrainSummary(steps=10, samples=1000, seconds=10.0, first_loss=1.0, last_loss=0.5)
    assert summary.samples_per_s == 100.0
    summary.compiled = CompileStats(seconds=8.0, graphs=3)
    assert summary.samples_per_s == 500.0
    assert "1000 samples, 500.0 samples/s" in summary.describe()
    assert "torch.compile: 8.0 s compiling (left out of samples/s), 3 graphs" in summary.describe()


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


@pytest.mark.timeout(300)
def test_fullgraph_over_a_graph_break_exits_2_naming_the_key(tmp_path, capsys, cli_group):
    """Dropout draws its mask from a generator of its own: a graph break dynamo cannot trace."""
    argv = [*COMMON, *AOT, "trainer.compile_options.fullgraph=true", f"trainer.output_dir={tmp_path}"]
    assert train_cli.run(argv) == 2
    (line,) = _error_lines(capsys)
    assert line.startswith("error: trainer.compile_options.fullgraph: torch.compile failed (")


def test_a_model_naming_no_dense_modules_exits_2_naming_the_key(tmp_path, capsys, cli_group):
    argv = [
        "model=custom",
        "model.builder=custom_components:build_model",
        "data=custom",
        "data.builder=custom_components:build_data",
        "trainer=smoke",
        "trainer.compile=true",
        f"trainer.output_dir={tmp_path}",
    ]
    assert train_cli.run(argv) == 2
    (line,) = _error_lines(capsys)
    assert line.startswith("error: trainer.compile: model 'custom") and "dense_modules()" in line


def test_eager_runs_record_no_compile_keys(tmp_path, cli_group):
    assert (
        train_cli.run([*COMMON[:5], "trainer.max_steps=2", "trainer.log_every=1", f"trainer.output_dir={tmp_path}"])
        == 0
    )
    (metrics,) = Path(tmp_path).glob("recsys-train/*/metrics.jsonl")
    assert not any(k.startswith("compile") for r in map(json.loads, metrics.read_text().splitlines()) for k in r)
