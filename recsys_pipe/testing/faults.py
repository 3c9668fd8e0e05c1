"""Fault injection into a training run, for the failure tests: `RECSYS_PIPE_FAULT` names the
fault, and `FAULT_OVERRIDE` makes any shipped plan's `zero_grad` task inject it."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from recsys_pipe import _ctrl_c

__all__ = ["FAULT_ENV", "FAULT_OVERRIDE", "PAUSE_ENV", "inject_fault", "zero_grad_with_fault"]

#: environment variable naming the moment a command waits at for a test's Ctrl-C (`pause_point`)
PAUSE_ENV = _ctrl_c.PAUSE_ENV
#: environment variable naming the fault `inject_fault` injects: "<kind>:<rank>:<step>"
FAULT_ENV = "RECSYS_PIPE_FAULT"
#: the override that makes any shipped plan inject that fault: its zero_grad task (the first
#: of each training step) goes through `zero_grad_with_fault`
FAULT_OVERRIDE = "pipeline.tasks.zero_grad.fn=recsys_pipe.testing:zero_grad_with_fault"


def zero_grad_with_fault(ctx: Any) -> None:
    """The `zero_grad` task, after `inject_fault` (see `FAULT_OVERRIDE`)."""
    from recsys_pipe.train.tasks import zero_grad

    inject_fault(ctx)
    zero_grad(ctx)


def inject_fault(ctx: Any) -> None:
    """Inject the fault `$RECSYS_PIPE_FAULT` names from a task, for failure tests.

    `RECSYS_PIPE_FAULT=<kind>:<rank>:<step>` fires on that rank in that training step (1-based,
    counted from the start of this process's training) of the task that calls it:
    `sigkill` (the process dies), `sigterm` (as a scheduler's preemption), `raise` (an exception
    in the task), `collective` (the rank's next collective fails), `hang` (the rank stops
    responding). Evaluation never fires it, nor a job restarted by torchrun (`--max-restarts`:
    `TORCHELASTIC_RESTART_COUNT` > 0), so a fault hits the first attempt only.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec or not ctx.state.training or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    kind, rank, step = spec.split(":")
    import torch.distributed as dist

    if dist.get_rank() != int(rank) or ctx.batch_index + 1 != int(step):
        return
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    elif kind == "collective":  # this rank's process group goes away: its next collective fails
        dist.destroy_process_group()
    elif kind == "hang":
        time.sleep(3600)
    else:
        raise ValueError(f"{FAULT_ENV}: unknown fault kind {kind!r} (sigkill, sigterm, raise, collective, hang)")
