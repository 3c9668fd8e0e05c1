"""Process-group lifetime for one training run: env:// under torchrun, a 1-rank group alone.

Teardown is deliberate (barrier, destroy, short pause): on gloo, letting the interpreter tear
the group down aborted roughly one run in ten.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 300) -> DistInfo:
    """Join the torchrun group (env://), or make a 1-rank group when run as a plain process."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(
            {
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(_free_port()),
            }
        )
    dev = resolve_device(device)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise RuntimeError("trainer.backend=nccl needs trainer.device=cuda; use gloo on the CPU")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(
        backend, timeout=datetime.timedelta(seconds=timeout_s), device_id=dev if dev.type == "cuda" else None
    )
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), dev, backend)


def shared_run_dir(base: str, name: str) -> str:
    """One run directory for all ranks: rank 0 picks the timestamp and broadcasts it (each
    process stamping its own time would split a run across directories)."""
    stamp = [datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")]
    dist.broadcast_object_list(stamp, src=0)
    path = os.path.join(base, name, stamp[0])
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path


def teardown() -> None:
    """Barrier, destroy the group, let gloo's threads wind down."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
        time.sleep(0.2)
