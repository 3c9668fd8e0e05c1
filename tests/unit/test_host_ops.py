"""`recsys_pipe.bench.host_ops`, the counter behind `recsys-bench train --host`: the operators
each task dispatches, those that launch a kernel, and the host syncs with their call sites."""

from __future__ import annotations

import pytest
import torch

from recsys_pipe.bench.host_ops import HostOps, _Counting, _Tally, launches
from recsys_pipe.engine import PlanRunner, Task, TaskGraph

pytestmark = pytest.mark.timeout(120)


def _tally(fn) -> _Tally:
    tally = _Tally()
    with _Counting(tally, device_run=False):
        fn()
    return tally


@pytest.mark.parametrize(
    "case, expected",
    [
        ("item", "item"),
        ("host_data", "tensor from host data"),
        ("repeat_interleave", "data-dependent size"),
        ("nonzero", "data-dependent size"),
        ("bool_mask", "data-dependent size"),
        ("sized_repeat_interleave", None),
        ("arithmetic", None),
    ],
)
def test_what_counts_as_a_host_sync(case, expected):
    x, r = torch.arange(6.0), torch.tensor([1, 2, 3])
    body = {
        "item": lambda: x.sum().item(),
        "host_data": lambda: torch.tensor([1, 2]),
        "repeat_interleave": lambda: torch.repeat_interleave(r, r),
        "nonzero": lambda: torch.nonzero(x),
        "bool_mask": lambda: x[x > 2],
        "sized_repeat_interleave": lambda: torch.repeat_interleave(r, r, output_size=6),
        "arithmetic": lambda: (x * 2 + 1).view(2, 3).t(),
    }[case]
    kinds = {kind for kind, _ in _tally(body).syncs}
    assert kinds == ({expected} if expected else set())


def test_views_and_allocations_launch_nothing():
    x = torch.ones(4, 4)
    tally = _tally(lambda: (x.view(16), x.t(), x[1:], torch.empty(3), x + 1, x.sum()))
    assert tally.ops["aten.add"] == 1 and tally.ops["aten.sum"] == 1 and tally.ops["aten.view"] == 1
    assert tally.launches == 2
    assert launches(torch.ops.aten.mm.default) and not launches(torch.ops.aten.t.default)


def test_counts_per_task_and_step_with_the_call_site():
    """Two tasks over 6 batches, 4 counted steps: each task's operators, launches and syncs per step,
    the `.item()` and `.tolist()` traced to the lines that called them."""
    x = torch.ones(8)

    def compute(ctx):
        (x + 1) * 2

    def read(ctx):
        x.sum().item()
        x[:2].tolist()

    tasks = [Task.from_fn("compute", compute), Task.from_fn("read", read, depends_on=["compute"])]
    host = HostOps(1, 5, device_run=False)
    with PlanRunner(TaskGraph.single_group(tasks), observer=host) as runner, host.counting():
        assert len(list(runner.iterate(range(6)))) == 6
    report = host.report(4)
    assert report["by_task"]["compute"] == {"ops": 2.0, "launches": 2.0, "syncs": 0.0}
    assert report["by_task"]["read"]["syncs"] == 2.0 and report["syncs_per_step"] == 2.0
    sites = list(report["sync_sites"])
    assert any(s.startswith("read: item at tests/unit/test_host_ops.py:") for s in sites), sites
    assert any(s.startswith("read: tolist at tests/unit/test_host_ops.py:") for s in sites), sites
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # put back


def test_a_triton_kernel_counts_as_one_launch():
    """The interpreted kernels' own operators (the interpreter's, on the CPU) are not the step's."""
    pytest.importorskip("triton", reason="the Triton attention's test needs the triton package (test extra)")
    from recsys_pipe.models.hstu_triton import jagged_hstu_attention, runs_on

    if not runs_on(torch.device("cpu")):
        pytest.skip("the kernels were compiled for CUDA (TRITON_INTERPRET unset)")
    offsets = torch.tensor([0, 3, 8])
    q, k, v = (torch.randn(8, 1, 16, requires_grad=True) for _ in "qkv")

    def attend(ctx):
        jagged_hstu_attention(q, k, v, offsets, 8).sum().backward()

    host = HostOps(0, 1, device_run=False)
    graph = TaskGraph.single_group([Task.from_fn("attend", attend)])
    with PlanRunner(graph, observer=host) as runner, host.counting():
        list(runner.iterate(range(1)))
    ops = host.tallies["attend"].ops
    assert ops["triton._fwd_kernel"] == 1 and ops["triton._dq_kernel"] == 1 and ops["triton._dkdv_kernel"] == 1
    assert sum(ops.values()) < 30, ops  # the interpreter runs hundreds of operators per kernel
