"""The cross-stream hand-off plan of the allocator tests on CPU: every `record_stream` placement
runs there (CPU tensors have no streams, so nothing is recorded) and every batch arrives intact.
The caching-allocator hazard itself exists only on CUDA: tests/cuda/test_cuda_allocator.py.
"""

import pytest
from _task_graphs import handoff_task_graph, handoff_value

from recsys_pipe.engine import PlanRunner, ThreadedExecutor


@pytest.mark.parametrize("executor", ["sequential", "threaded"])
@pytest.mark.parametrize("record_stream", ["producer", "consumer", "none"])
def test_handoff_plan_on_cpu(record_stream, executor):
    executor = ThreadedExecutor() if executor == "threaded" else executor
    with PlanRunner(handoff_task_graph(record_stream), executor=executor) as runner:
        results = list(runner.iterate(range(5)))
    assert [sorted(set(r.tolist())) for r in results] == [[handoff_value(b)] for b in range(5)]


def test_handoff_plan_rejects_an_unknown_placement():
    with pytest.raises(ValueError, match="record_stream must be producer, consumer or none"):
        handoff_task_graph("both")
