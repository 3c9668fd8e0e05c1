"""`Parallelism`: the seam of how a run spreads its model over the ranks (see the package)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from recsys_pipe.config import CompiledPlan
    from recsys_pipe.data.batch import DataSpec
    from recsys_pipe.engine import StreamPool
    from recsys_pipe.runtime.distributed import DistInfo
    from recsys_pipe.train.config import RunConfig
    from recsys_pipe.train.parallel.topology import Topology
    from recsys_pipe.train.rng import RngState

__all__ = ["Parallelism"]


class Parallelism(ABC):
    """How `run`'s model is spread over the ranks. The defaults describe one data-parallel
    replica per rank; an implementation overrides what it does differently."""

    #: the layout of the optimizer state in checkpoints: flattened (hyperparameters keyed by
    #: parameter name) when ranks hold different parameters, so no rank's param groups
    #: override another's; DCP's default (one list of param groups, the same on every rank) else
    flat_optimizer_state: bool = False

    def __init__(self, run: RunConfig):
        self.run = run

    # -- before any process group -----------------------------------------------------------------

    @abstractmethod
    def check(self, topology: Topology) -> None:
        """ConfigError (with config paths) for what this layout cannot train on `topology`'s
        ranks; checked before any process group starts."""

    def table_shapes(self) -> dict[str, tuple[int, int]] | None:
        """The config's torchrec tables by name, (rows, dim), for checking a checkpoint before
        it is loaded; None for a layout without torchrec tables."""
        return None

    def check_export(self) -> None:
        """ConfigError (with config paths) if a checkpoint of this layout cannot be loaded as one
        unsharded model for `recsys-export`; every layout whose ranks hold whole replicas can."""
        return None

    # -- the data ---------------------------------------------------------------------------------

    def ranks_per_replica(self) -> int:
        """Ranks that train one data-parallel replica together (and read the same batches)."""
        return 1

    def replicas(self, world_size: int) -> int:
        """Data-parallel replicas of a world of `world_size` ranks: a step trains this many batches."""
        return world_size // self.ranks_per_replica()

    def data_share(self, rank: int, world_size: int) -> tuple[int, int]:
        """(this rank's share, the number of shares) of the training data: one share per replica."""
        replicas = self.replicas(world_size)
        return rank % replicas, replicas

    # -- the build phase --------------------------------------------------------------------------

    @abstractmethod
    def build_model(self, spec: DataSpec, info: DistInfo, rng: RngState) -> tuple[nn.Module, Any]:
        """The model spread over the process group, and its optimizer; the same initial weights
        on every rank (seeded). Dropout draws from `rng`'s dropout stream."""

    def input_dist(self, model: nn.Module, info: DistInfo, streams: StreamPool, plan: CompiledPlan) -> Any:
        """What runs the input distribution of sharded tables ahead of the forward (the plan's
        `start_input_dist` / `wait_input_dist` tasks), or None when the model needs none."""
        return None

    # -- while training ---------------------------------------------------------------------------

    def replica_mean(self, model: nn.Module, info: DistInfo, value: torch.Tensor) -> float:
        """A per-replica value (a step's loss) averaged over the data-parallel replicas."""
        value = value.detach().float().reshape(1).clone()
        if info.world_size > 1:
            dist.all_reduce(value)
            value /= info.world_size
        return float(value)

    # -- tools ------------------------------------------------------------------------------------

    @abstractmethod
    def describe_model(self, plan: CompiledPlan, world_size: int, local_size: int, device_type: str) -> str:
        """What `recsys-plan` says about how the model is spread over `world_size` ranks
        (`local_size` per host) on `device_type` (no table memory is allocated)."""

    def planned_model(self, topology: Topology) -> tuple[nn.Module, Any] | None:
        """For the memory estimate (`recsys_pipe.train.memory`): the model built on the meta
        device and torchrec's sharding plan of its tables over `topology`'s ranks (None when no
        tables are sharded); None when this layout's memory is not estimated."""
        with torch.device("meta"):
            return self.run.model.build(self.run.data.spec()), None

    def describe_steps(self) -> str | None:
        """What `recsys-plan` shows of each rank's share of one step beyond the plan, if anything."""
        return None

    def start_profiling(self, model: nn.Module) -> None:
        """`recsys-profile` is about to measure: record what `profile_files` writes (nothing by default)."""
        return None

    def profile_files(self, model: nn.Module, out: Path) -> list[Path]:
        """After `recsys-profile` measured: the extra files this layout writes into `out` (every
        rank calls it; it may be a collective)."""
        return []
