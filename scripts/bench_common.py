"""What the benchmark scripts share: the median (min-max) summary they report, and the re-launch
of a multi-rank benchmark under torchrun when it was started as a plain script."""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Iterable

__all__ = ["reexec_under_torchrun", "summary"]


def summary(values: Iterable[float], digits: int = 3) -> dict[str, float]:
    """Median, min and max of `values`, rounded to `digits`."""
    values = list(values)
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def reexec_under_torchrun(script: str, nproc: int) -> None:
    """Replace this process by `torchrun --standalone --nproc_per_node nproc script args...`
    (one intra-op thread per rank), unless it already is a torchrun worker."""
    if "LOCAL_RANK" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    command = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    os.execv(sys.executable, [sys.executable, *command, os.path.abspath(script), *sys.argv[1:]])
