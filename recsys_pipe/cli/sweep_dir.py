"""`${recsys_sweep_dir:<base>}`: the directory of one `-m` sweep, the same on every rank.

Also the client of torchrun's rendezvous store that the ranks use to agree on something before
any process group exists (this directory, and which rank reports a config error).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

__all__ = ["sweep_dir", "torchrun_store"]

_SWEEP_DIRS: dict[str, str] = {}


def sweep_dir(base: str) -> str:
    """`${recsys_sweep_dir:<base>}`: a new directory `<base>/<time>` for one `-m` sweep.

    Unique (`-2`, `-3`, ... when two sweeps start in the same second) and, under torchrun, the
    same for every rank: local rank 0 of global rank 0 creates it and publishes the path in
    torchrun's store, the others read it there. Hydra resolves this more than once per sweep,
    so the answer is kept per process.
    """
    if base in _SWEEP_DIRS:
        return _SWEEP_DIRS[base]
    from recsys_pipe.runtime.rundir import unique_dir

    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "TORCHELASTIC_RUN_ID" in os.environ:
        store = torchrun_store(timeout_s=300)
        key = f"recsys_pipe/sweep_dir/{base}"
        if os.environ.get("RANK") == "0":
            store.set(key, unique_dir(base, stamp))
        path = store.get(key).decode()  # waits for rank 0
    else:
        path = unique_dir(base, stamp)
    _SWEEP_DIRS[base] = path
    return path


def torchrun_store(timeout_s: float) -> Any:
    """A client of torchrun's own rendezvous store (MASTER_ADDR:MASTER_PORT), for the ranks to
    agree on something before any process group exists."""
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
