"""A small pipelined program written with the engine alone (no torchrec, no Hydra).

Batch preparation runs one batch ahead on its own stream and thread while the current batch
trains; the serial plan runs the same two task functions at lookahead 0. Both give the same
losses, because every batch still meets the same weights in the same order.

    recsys-bench engine_example
    python -m recsys_pipe.bench.engine_example    # the same, without the console script
"""

import statistics

import torch

from recsys_pipe.engine import (
    BATCH_CPU,
    STEP_RESULT,
    PlanRunner,
    SpanRecorder,
    StreamPool,
    Task,
    TaskGraph,
    TaskObserver,
)


def prepare(ctx):  # runs on batch K+1 while train runs on batch K
    """Standardise the batch's features (the preparation the plan with lookaheads runs one batch ahead)."""
    x, y = ctx.slots[BATCH_CPU]
    ctx.slots.set("batch", ((x - x.mean(0)) / (x.std(0) + 1e-6), y))


def train(ctx):
    """One SGD step of the linear model on the prepared batch; the loss is the step's result."""
    model, opt = ctx.state
    x, y = ctx.slots["batch"]
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
    loss.backward()
    opt.step()
    ctx.slots.set(STEP_RESULT, loss.item())


def plan(lookahead: int) -> TaskGraph:
    """The two tasks, `prepare` `lookahead` batches ahead on the `memcpy` stream (0: the serial plan)."""
    return TaskGraph.single_group(
        [
            Task.from_fn("prepare", prepare, stream="memcpy", lookahead=lookahead, reads=[BATCH_CPU], writes=["batch"]),
            Task.from_fn("train", train, reads=["batch"], writes=[STEP_RESULT]),
        ]
    )


def batches(n: int):
    """`n` seeded (features, target) batches of a linear problem."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, generator=g)
    for _ in range(n):
        x = torch.randn(64, 8, generator=g) * 3 + 1
        yield x, x @ w


def run(lookahead: int, executor: str, observer: TaskObserver | None = None) -> list[float]:
    """Train a fresh seeded model on 50 batches with `plan(lookahead)`; the per-batch losses."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    state = (model, torch.optim.SGD(model.parameters(), lr=0.05))
    pool = StreamPool.create(["default", "memcpy"], "cuda" if torch.cuda.is_available() else None)
    losses = []
    with PlanRunner(plan(lookahead), pool, executor, state=state, observer=observer) as runner:
        for loss in runner.iterate(batches(50)):  # one batch's step_result at a time, until drained
            losses.append(loss)
    return losses


if __name__ == "__main__":
    serial = run(lookahead=0, executor="sequential")
    recorder = SpanRecorder()  # times every task invocation, on the thread that ran it
    with_lookaheads = run(lookahead=1, executor="threaded", observer=recorder)
    assert with_lookaheads == serial, "plan with lookaheads must match the serial plan"
    print(f"50 batches, identical losses: first {serial[0]:.4f} -> last {serial[-1]:.4f}")
    for task in ("prepare", "train"):
        spans = [s for s in recorder.spans(first=5) if s.task == task]
        median_us = statistics.median(s.duration_s for s in spans) * 1e6
        print(f"  {task:<8} on thread {spans[0].thread}: median {median_us:.0f} µs over {len(spans)} batches")
