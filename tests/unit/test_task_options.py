"""Task options (`pipeline.tasks.<task>.options`): validated by the task's registered model, with
config paths; reach the task function; h2d's in-place copy and the lookup tasks' batch ranges."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from recsys_pipe.config import ConfigError, compile_plan, task_options
from recsys_pipe.data import make_dataloader
from recsys_pipe.engine import Task
from recsys_pipe.engine.testing import recording_pool
from recsys_pipe.testing import load_run
from recsys_pipe.train import tasks as task_module
from recsys_pipe.train.lookup_tasks import LookupOptions, StashOptions
from recsys_pipe.train.slots import BATCH_CPU, BATCH_GPU
from recsys_pipe.train.tasks import H2DOptions, h2d


def _plan(**h2d_options):
    plan = load_run("pipeline=sparse_dist").pipeline.model_dump()
    plan["tasks"]["h2d"]["options"] = h2d_options
    return plan


def test_options_reach_the_engine_task_validated_with_defaults():
    compiled = compile_plan(_plan(inplace_copy=True))
    task = next(t for t in compiled.order if t.name == "h2d")
    assert task.options == H2DOptions(inplace_copy=True)
    untouched = next(t for t in compile_plan(_plan()).order if t.name == "h2d")
    assert untouched.options == H2DOptions()  # the model's defaults, not None
    forward = next(t for t in compiled.order if t.name == "forward")
    assert forward.options is None  # a task without an options model


@pytest.mark.parametrize(
    ("options", "path", "fragment"),
    [
        ({"inplace": True}, "pipeline.tasks.h2d.options.inplace", "did you mean 'inplace_copy'?"),
        ({"inplace_copy": "maybe"}, "pipeline.tasks.h2d.options.inplace_copy", "valid boolean"),
    ],
)
def test_bad_options_are_config_errors_with_their_path(options, path, fragment):
    with pytest.raises(ConfigError) as info:
        compile_plan(_plan(**options))
    (problem,) = info.value.problems
    assert problem.path == path and fragment in problem.message


def test_options_of_a_task_that_takes_none_are_refused():
    plan = _plan()
    plan["tasks"]["forward"]["options"] = {"x": 1}
    with pytest.raises(ConfigError) as info:
        compile_plan(plan)
    assert [(p.path, p.message) for p in info.value.problems] == [
        ("pipeline.tasks.forward.options", "task 'forward' takes no options (got x)")
    ]


def test_a_users_unregistered_function_gets_its_options_as_written():
    plan = _plan()
    plan["tasks"]["zero_grad"]["fn"] = "recsys_pipe.testing:zero_grad_with_fault"
    plan["tasks"]["zero_grad"]["options"] = {"anything": [1, 2]}
    task = next(t for t in compile_plan(plan).order if t.name == "zero_grad")
    assert task.options == {"anything": [1, 2]}


def test_options_are_overridable_from_the_command_line_and_shown_by_recsys_plan(tmp_path, capsys):
    from recsys_pipe.cli.plan import run

    code = run(["pipeline=sparse_dist", "pipeline.tasks.h2d.options.inplace_copy=true", f"hydra.run.dir={tmp_path}"])
    assert code == 0
    assert "task options (as the plan sets them" in capsys.readouterr().out
    assert "  h2d: inplace_copy=true" in (tmp_path / "plan.txt").read_text()
    assert run(["pipeline=sparse_dist", "pipeline.tasks.h2d.options.inplace_copy=2", f"hydra.run.dir={tmp_path}"]) == 2
    assert "error: pipeline.tasks.h2d.options.inplace_copy:" in capsys.readouterr().err


def test_task_options_falls_back_to_the_defaults_and_checks_the_type():
    ctx = SimpleNamespace(task=Task.from_fn("h2d", h2d))
    assert task_options(ctx, H2DOptions) == H2DOptions()
    ctx.task = Task.from_fn("h2d", h2d, options=StashOptions())
    with pytest.raises(TypeError, match="expected H2DOptions"):
        task_options(ctx, H2DOptions)


class _Slots(dict):
    def set(self, key, value):
        self[key] = value


def _h2d(monkeypatch, inplace: bool):
    """Run h2d on a real batch (tensors and a KJT) over recording streams; returns the batches,
    the stream log and how often the batch was recorded on other streams."""
    run = load_run("pipeline=sparse_dist")
    batch = next(iter(make_dataloader(run.data)))
    pool, log = recording_pool(["default", "memcpy", "data_dist"])
    kept = []
    monkeypatch.setattr(task_module, "_keep_alive", lambda b, ctx: kept.append(b))
    task = Task.from_fn(
        "h2d", h2d, stream="memcpy", lookahead=2, writes=["batch_gpu"], options=H2DOptions(inplace_copy=inplace)
    )
    ctx = SimpleNamespace(
        slots=_Slots({BATCH_CPU: batch}),
        state=SimpleNamespace(device=torch.device("cpu"), streams=pool, sparse_dist=None),
        task=task,
        stream=pool.get("memcpy"),
        batch_index=0,
    )
    with pool.use("memcpy", "h2d"):
        h2d(ctx)
    return batch, ctx.slots[BATCH_GPU], [(op.stream, op.kind, op.arg) for op in log.ops], len(kept)


def test_inplace_copy_allocates_on_the_default_stream_and_copies_after_it(monkeypatch):
    batch, moved, ops, kept = _h2d(monkeypatch, inplace=True)
    assert ops == [
        ("memcpy", "begin", "h2d"),
        ("default", "begin", None),  # the allocation, on the stream that trains the batch
        ("default", "end", None),
        ("memcpy", "wait_stream", "default"),  # the copy waits for it
        ("memcpy", "end", "h2d"),
    ]
    assert kept == 0  # no record_stream: the default stream owns the memory
    assert moved is not batch and moved.sample_ids.data_ptr() != batch.sample_ids.data_ptr()
    assert torch.equal(moved.sample_ids, batch.sample_ids)
    kjt, src = moved.sparse_features, batch.sparse_features
    assert kjt.keys() == src.keys() and torch.equal(kjt.values(), src.values())
    assert torch.equal(kjt.lengths(), src.lengths())


def test_plain_copy_records_the_batch_on_the_other_streams(monkeypatch):
    batch, moved, ops, kept = _h2d(monkeypatch, inplace=False)
    assert ops == [("memcpy", "begin", "h2d"), ("memcpy", "end", "h2d")]
    assert kept == 1 and torch.equal(moved.sample_ids, batch.sample_ids)


@pytest.mark.parametrize(
    ("options", "batches"),
    [
        (LookupOptions(), range(8)),
        (LookupOptions(start_batch=0, batches="after"), range(1, 8)),
        (LookupOptions(start_batch=0, batches="until"), [0]),
        (LookupOptions(start_batch=3, batches="after"), range(4, 8)),
        (LookupOptions(start_batch=3, batches="until"), range(4)),
    ],
)
def test_lookup_options_split_the_batches_between_the_two_lookups(options, batches):
    assert [i for i in range(8) if options.looks_up(i)] == list(batches)
