"""`Topology`: the ranks a run is checked or planned for (how many, how many per host, which device)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from recsys_pipe.config import ConfigError, ConfigProblem

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """`world_size` ranks, `local_world_size` of them per host, on `device_type` (`cpu`/`cuda`).

    `local_key` names where the ranks per host came from, for errors: torchrun's
    `LOCAL_WORLD_SIZE` (its `--nproc_per_node`) for a job, the `local_world_size` key for
    `recsys-plan`."""

    world_size: int
    local_world_size: int
    device_type: str
    local_key: str = "LOCAL_WORLD_SIZE"

    @classmethod
    def of_job(cls, device_type: str) -> Topology:
        """This process's job as torchrun describes it (`WORLD_SIZE`, `LOCAL_WORLD_SIZE`); one
        rank when not started by torchrun, and one host when `LOCAL_WORLD_SIZE` is unset."""
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        return cls(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), device_type)

    @property
    def hosts(self) -> int:
        return self.world_size // self.local_world_size

    def check(self) -> None:
        """ConfigError (at `local_key`) unless the hosts hold the same number of ranks: torchrec
        places shards host by host, and its planner's topology assumes equal hosts."""
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ConfigError(
                ConfigProblem(
                    self.local_key,
                    f"{self.local_world_size} ranks per host do not divide the {self.world_size} ranks: every host "
                    "must run the same number of ranks (torchrun's --nproc_per_node on every node)",
                )
            )
