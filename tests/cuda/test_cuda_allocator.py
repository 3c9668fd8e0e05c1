"""Caching-allocator safety: memory made on one stream and read on another.

The engine orders streams; it does not tell the caching allocator which streams use a tensor.
When the ring drops a batch's values, their memory goes back to the allocator at once, on the
stream that allocated it, while another stream may still have a read of it queued. The rule for
task authors (README, "GPU"): a tensor read on another stream than the one that allocated it
must be `record_stream`ed for that stream, by its producer (as the training h2d task does, for
every other stream of the pool) or by its reader. These tests show both placements keep the
values intact and that without either the memory is reused under the reader.
"""

import pytest
import torch
from _task_graphs import handoff_task_graph, handoff_value

from recsys_pipe.engine import PlanRunner, StreamPool

pytestmark = pytest.mark.timeout(120)

READER_BUSY_MS = 20.0  # the reader's stream is busy this long before each copy
BATCHES = 8


def handoff(record_stream, executor):
    pool = StreamPool.create(["default", "side"], "cuda")
    with PlanRunner(handoff_task_graph(record_stream, READER_BUSY_MS), pool, executor) as runner:
        results = list(runner.iterate(range(BATCHES)))
    torch.cuda.synchronize()
    return {b: sorted({int(v) for v in r.unique().tolist()}) for b, r in enumerate(results)}


@pytest.mark.parametrize("executor", ["sequential", "threaded"])
@pytest.mark.parametrize("record_stream", ["producer", "consumer"])
def test_record_stream_keeps_the_memory_until_the_reader_is_done(record_stream, executor):
    seen = handoff(record_stream, executor)
    assert seen == {b: [handoff_value(b)] for b in range(BATCHES)}


@pytest.mark.parametrize("executor", ["sequential", "threaded"])
def test_without_record_stream_a_later_batch_overwrites_what_the_reader_copies(executor):
    seen = handoff("none", executor)
    overwritten = {b: values for b, values in seen.items() if values != [handoff_value(b)]}
    assert overwritten, "the reader saw every batch intact: the hazard this rule guards against did not show"
    for b, values in overwritten.items():  # what it saw instead is a later batch's value
        assert all(v > handoff_value(b) for v in values), (b, values)
