"""Each rank's measured F / B / W spans of a pipelined step, and the transfer time between ranks.

The engine's `SpanRecorder` times every task a rank runs; `compute_spans` keeps its compute
steps (forward, input gradient, weight gradient, full backward) as `PipelineSpan`s
(`recsys_pipe.pp_schedules.spans`), and `gather_spans` brings every rank's together. What they
mean (a `PipelineResult` of the measured step, its simulation from the measured means) is the
analysis's: `recsys_pipe.autosched.pipeline_parallel.measured_result` and `simulate_measured`.
The transfers are not compute: a rank blocked in a receive is idle, part of its bubble.

Times come from `time.perf_counter` in each rank's process; on one host that clock (Linux
CLOCK_MONOTONIC) is shared, so spans of different ranks line up. Across hosts only each rank's
own window (`bubble_without_sync`, busy) is meaningful.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from recsys_pipe.engine import TaskSpan
from recsys_pipe.pp.p2p import PeerLink
from recsys_pipe.pp_schedules import Action
from recsys_pipe.pp_schedules.spans import PipelineSpan

__all__ = [
    "PROBE_TAG",
    "compute_spans",
    "gather_spans",
    "task_gaps",
    "transfer_time",
]

#: the tag of `transfer_time`'s messages: above every stage's activation and gradient tags
#: (`recsys_pipe.pp.p2p`) for pipelines of up to 511 stages
PROBE_TAG = 1 << 30

_STEPS = ("F", "B", "W", "BW")


def _action(span: TaskSpan) -> Action | None:
    """The compute step a task ran: tasks are named as torch prints actions (2F0, 3I1, ...)."""
    try:
        action = Action.parse(span.task)
    except ValueError:
        return None
    return action if action is not None and action.kind in _STEPS else None


def compute_spans(spans: Sequence[TaskSpan], rank: int) -> list[PipelineSpan]:
    """Rank `rank`'s compute steps among `spans` (an `ActionOrderRunner`'s tasks), in start order."""
    out = []
    for span in sorted(spans, key=lambda s: s.start_s):
        action = _action(span)
        if action is not None:
            out.append(PipelineSpan(rank, str(action), action.microbatch, span.start_s, span.end_s, action.short))
    return out


def gather_spans(local: Sequence[PipelineSpan], group: dist.ProcessGroup | None = None) -> list[list[PipelineSpan]]:
    """Every rank's spans, indexed by rank in `group` (a collective: every rank calls it)."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, list(local), group=group)
    return gathered


def transfer_time(link: PeerLink, peer: int, message: Sequence[torch.Tensor] | None = None, rounds: int = 20) -> float:
    """The median one-way time (seconds) of one stage message between this rank and `peer`,
    through `link` as the runtime sends it (`send`, then the peer's blocking `recv`): half a
    round trip of a ping-pong. The rank given `message` (one microbatch's activation, the
    tensors a stage sends) starts each round; `peer` calls it with no message and echoes what it
    receives, so only one side needs to know the shapes. Both ranks return the median round
    trip as each sees it, halved. Outside a step only: no other transfer may be in flight on `link`.
    """
    if rounds < 2:
        raise ValueError(f"a ping-pong needs at least 2 rounds, got {rounds}")
    times, last = [], None
    for _ in range(rounds):
        if message is not None:
            start = time.perf_counter()
            link.send(message, peer, PROBE_TAG)
            link.recv(peer, PROBE_TAG)
            times.append(time.perf_counter() - start)
        else:  # a round trip: from one receive to the next, the echo and the leader's turn between
            received = link.recv(peer, PROBE_TAG)
            now = time.perf_counter()
            if last is not None:
                times.append(now - last)
            last = now
            link.send(received, peer, PROBE_TAG)
        link.wait_sends()
    return statistics.median(times) / 2


def task_gaps(spans: Sequence[TaskSpan]) -> list[float]:
    """The engine's own time between consecutive tasks of one rank (seconds; the next start
    minus the previous end, spans in start order): dispatch and bookkeeping, no waiting (a
    receive waits inside its task)."""
    ordered = sorted(spans, key=lambda s: s.start_s)
    return [b.start_s - a.end_s for a, b in zip(ordered, ordered[1:])]
