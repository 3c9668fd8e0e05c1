"""Where a rank sits in a pipeline-parallel x data-parallel world.

The world is a 2-D mesh (torch's `DeviceMesh`, dimensions `pp` x `dp`, row-major): rank
`pp_rank * dp_size + dp_rank`. The ranks of one pipeline position form its data-parallel group
(contiguous, so the first stage's embedding tables shard over ranks 0..dp-1: `table_group`);
one data-parallel replica's pipeline is the column `dp_rank`, and its transfers go to the ranks
of that column.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["PipelineMesh"]


@dataclass(frozen=True)
class PipelineMesh:
    """This rank's coordinates in the `pp` x `dp` mesh."""

    mesh: DeviceMesh

    @classmethod
    def create(cls, pp_size: int, device_type: str = "cpu") -> PipelineMesh:
        """The mesh over the whole (initialised) process group; collective: every rank calls it."""
        world = dist.get_world_size()
        if world % pp_size:
            raise ValueError(f"{pp_size} pipeline ranks do not divide the world of {world}")
        return cls(init_device_mesh(device_type, (pp_size, world // pp_size), mesh_dim_names=("pp", "dp")))

    @property
    def pp_size(self) -> int:
        """Pipeline stages per replica (ranks along the `pp` dimension)."""
        return self.mesh.size(0)

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas of the pipeline (ranks along the `dp` dimension)."""
        return self.mesh.size(1)

    @property
    def pp_rank(self) -> int:
        """This rank's position in its pipeline."""
        return self.mesh.get_local_rank("pp")

    @property
    def dp_rank(self) -> int:
        """This rank's replica."""
        return self.mesh.get_local_rank("dp")

    def rank_of(self, pp_rank: int) -> int:
        """The global rank of pipeline position `pp_rank` in this rank's data-parallel replica."""
        return int(self.mesh.mesh[pp_rank, self.dp_rank])

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding this rank's stages in the other replicas; None without data parallelism."""
        return self.table_group if self.dp_size > 1 else None

    @property
    def table_group(self) -> dist.ProcessGroup:
        """The group the first stage's embedding tables shard over: its data-parallel group,
        this rank alone without data parallelism (torchrec shards over a process group)."""
        return self.mesh.get_group("dp")
