"""Process-group lifetime for one training process: env:// under torchrun, a 1-rank group alone.

Besides the training group (gloo on the CPU, NCCL on CUDA), `init_distributed` makes two small
gloo groups with their own connections: `control` (the per-step preemption agreement) and
`checkpoint` (DCP's collectives, which an asynchronous save issues from a background thread).
Collectives of one group must be issued in the same order on every rank; separate groups keep
these side channels from ever interleaving with training's collectives.

Teardown is deliberate (barrier, destroy, short pause): on gloo, letting the interpreter tear
the group down aborted roughly one run in ten.
"""

from __future__ import annotations

import atexit
import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "init_distributed", "resolve_device", "teardown"]


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job, as `init_distributed` set it up.

    Attributes:
        rank: this process's global rank.
        world_size: the number of processes of the job.
        local_rank: this process's rank on its node (its GPU index on CUDA).
        device: the device this rank trains on.
        backend: the training process group's backend (`gloo` or `nccl`)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    #: processes of this rank's node (torchrun's LOCAL_WORLD_SIZE); < world_size across nodes
    local_world_size: int = 1
    #: gloo group of the per-step preemption agreement
    control_group: dist.ProcessGroup | None = None
    #: gloo group of checkpoint collectives
    checkpoint_group: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, which writes the run directory's shared files."""
        return self.rank == 0


def resolve_device(device: str) -> torch.device:
    """ "auto": this rank's GPU when CUDA is available, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _own_store(timeout: datetime.timedelta) -> dist.TCPStore:
    """The store of a 1-rank group run as a plain process, on a port the OS picks as it binds.
    Asking for a free port first and binding it later races with every other process doing the
    same (seen: EADDRINUSE when tests start runs side by side); binding port 0 cannot. The
    group's variables go to the environment, where the health watch and sweep-directory clients
    look for them, until `teardown` takes them out again."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout)
    _OWN_ENV.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
    )
    os.environ.update(_OWN_ENV)
    return store


#: the variables `_own_store` wrote: a process that trains again after `teardown` (a test, a
#: notebook) or starts a subprocess must not read them as torchrun's
_OWN_ENV: dict[str, str] = {}

_INFO: DistInfo | None = None


def _restart_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The store of a job torchrun restarted (`--max-restarts`: `TORCHELASTIC_RESTART_COUNT` > 0)
    on its own agent store, under a prefix of this attempt; None otherwise (env:// as usual).
    The agent keeps its store across restarts, so the keys the ranks of the attempt before
    wrote (gloo's addresses of processes now dead) would otherwise be read by this attempt's
    ranks, which then fail to connect (seen: a restarted job timing out in connectFullMesh)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"recsys_pipe/attempt_{attempt}", agent)


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 300) -> DistInfo:
    """Join the torchrun group (env://), or make a 1-rank group when run as a plain process.

    Idempotent within a process: a Hydra sweep (`-m`) runs several jobs in one process, and
    every job of it reuses the group made for the first (re-initialising one under torchrun
    would rendezvous again on a store that already holds the first round's keys, and hang).

    Args:
        device: `trainer.device`: `auto`, `cpu` or `cuda`.
        backend: `trainer.backend`: `auto` (NCCL on CUDA, gloo on the CPU), `gloo` or `nccl`.
        timeout_s: how long a collective may wait before it fails.

    Returns:
        This process's `DistInfo` (rank, world size, device, backend, side groups)."""
    global _INFO
    if _INFO is not None and dist.is_initialized():
        return _INFO
    timeout = datetime.timedelta(seconds=timeout_s)
    store: dist.Store | None = None
    if "WORLD_SIZE" not in os.environ:
        store = _own_store(timeout)
    dev = resolve_device(device)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise RuntimeError("trainer.backend=nccl needs trainer.device=cuda; use gloo on the CPU")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = store or _restart_store(timeout)
    ranks = {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])} if store else {}
    dist.init_process_group(
        backend, timeout=timeout, device_id=dev if dev.type == "cuda" else None, store=store, **ranks
    )
    world_size = dist.get_world_size()
    _INFO = DistInfo(
        rank=dist.get_rank(),
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        device=dev,
        backend=backend,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        control_group=dist.new_group(backend="gloo", timeout=timeout),
        checkpoint_group=dist.new_group(backend="gloo", timeout=timeout),
    )
    return _INFO


def _let_gloo_wind_down() -> None:
    """Before the interpreter exits after a process group: a moment for gloo's threads to end
    (exiting while they still run can abort the process)."""
    time.sleep(0.2)


def teardown() -> None:
    """Barrier, destroy the group; take out of the environment what a plain process's group put
    there. Gloo's threads get their moment to wind down when the interpreter exits, once, not
    after every group (a process that trains again, such as a test runner, does not wait)."""
    global _INFO
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
        _INFO = None
        for key, value in _OWN_ENV.items():
            if os.environ.get(key) == value:
                del os.environ[key]
        _OWN_ENV.clear()
        atexit.unregister(_let_gloo_wind_down)  # registered once however many groups came and went
        atexit.register(_let_gloo_wind_down)
