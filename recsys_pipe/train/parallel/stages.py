"""`PipelineStages`: the model's layers cut into stages over ranks (`parallel.pp`), each stage's
replicas data-parallel; the runtime is `recsys_pipe.pp`, this module is its only door into the
training loop and the commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.models.base import ShardedModelConfig
from recsys_pipe.pp.config import check_pipeline_parallel, pipelined_tables
from recsys_pipe.train.dense_ddp import check_dense_ddp
from recsys_pipe.train.managed import refuse_managed
from recsys_pipe.train.optim import dense_optimizer_factory
from recsys_pipe.train.parallel.base import Parallelism
from recsys_pipe.train.parallel.sharded import describe_sharding

if TYPE_CHECKING:
    from recsys_pipe.config import CompiledPlan
    from recsys_pipe.data.batch import DataSpec
    from recsys_pipe.pp.schedules import ResolvedSchedule
    from recsys_pipe.runtime.distributed import DistInfo
    from recsys_pipe.train.parallel.topology import Topology
    from recsys_pipe.train.rng import RngState

__all__ = ["PipelineStages"]


class PipelineStages(Parallelism):
    """Each rank holds its stages of the model (`recsys_pipe.pp.train.PipelinedModel`); the ranks
    of one pipeline read the same batches, one pipeline per data-parallel replica."""

    #: ranks hold different parameters (their stages)
    flat_optimizer_state = True

    def check(self, topology: Topology) -> None:
        # the first stage's tables train on torchrec's dense kernel: no fused optimizer to check
        topology.check()
        check_dense_ddp(self.run, topology.device_type)
        check_pipeline_parallel(self.run, topology.world_size)
        if getattr(self.run.model, "table_init", "unsharded") == "per_shard":
            raise ConfigError(
                ConfigProblem(
                    "model.table_init",
                    "per_shard is not offered with pipeline stages (parallel.pp.size > 1): their stages are cut from "
                    "the unsharded model; use model.table_init=unsharded",
                )
            )
        refuse_managed(
            self.run.data.spec(),
            "pipeline stages (parallel.pp.size > 1) train the first stage's tables on torchrec's dense kernel, which "
            "managed-collision tables do not offer: train without parallel.pp",
        )

    def check_export(self) -> None:
        raise ConfigError(
            ConfigProblem("parallel.pp.size", "a pipeline-parallel run's stages cannot be exported as one model yet")
        )

    def ranks_per_replica(self) -> int:
        return self.run.parallel.pp.size

    def data_share(self, rank: int, world_size: int) -> tuple[int, int]:
        # mesh rank = pp_rank * replicas + replica: the ranks of one pipeline share a replica's batches
        replicas = self.replicas(world_size)
        return rank % replicas, replicas

    def build_model(self, spec: DataSpec, info: DistInfo, rng: RngState) -> tuple[nn.Module, Any]:
        from recsys_pipe.pp.train import build_pipelined_model

        model = build_pipelined_model(self.run, info, spec)  # its dropout is keyed by microbatch, not `rng`
        return model, dense_optimizer_factory(self.run.optimizer)(model.parameters())

    def replica_mean(self, model: nn.Module, info: DistInfo, value: torch.Tensor) -> float:
        return model.replica_mean(value)  # type: ignore[operator]

    def describe_model(self, plan: CompiledPlan, world_size: int, local_size: int, device_type: str) -> str:
        run = self.run
        if not isinstance(run.model, ShardedModelConfig):
            return f"model: {run.model.label} (plain torch tables, in the first stage of each pipeline)"
        ranks = max(1, world_size // run.parallel.pp.size)  # the first stage's tables, over its replicas
        cfg = pipelined_tables(run.model)
        return describe_sharding(run, cfg, ranks, min(local_size, ranks), device_type, " (the first stage's replicas)")

    def planned_model(self, topology: Topology) -> None:
        return None  # the memory estimate does not cut the model into stages yet

    def describe_steps(self) -> str | None:
        from recsys_pipe.train.parallel.stage_text import render_pipeline_parallel

        return render_pipeline_parallel(self.run.parallel.pp)

    def start_profiling(self, model: nn.Module) -> None:
        model.record_timelines()  # type: ignore[operator]

    def profile_files(self, model: nn.Module, out: Path) -> list[Path]:
        return write_step_timeline(model, out, self.run.parallel.pp.resolved())


def write_step_timeline(model: Any, out: Path, schedule: ResolvedSchedule) -> list[Path]:
    """The last recorded step of this rank's pipeline (`PipelinedModel.record_timelines`),
    measured and simulated (a collective over the pipeline's ranks): global rank 0 writes
    `pp_timeline.png` (measured Gantt), `pp_simulated.png` (the schedule simulated with the
    measured means of F, B and W and the measured transfer time, `transfer_ms`) and
    `pp_timeline.json` (per rank: busy time and bubble), and prints the table."""
    from recsys_pipe.autosched.pipeline_parallel import measured_result, simulate_measured

    t_comm = model.transfer_ms() / 1e3  # global rank 0 is pipeline rank 0: it measures
    gathered = model.gathered_spans()
    if dist.get_rank() != 0:
        return []
    measured = measured_result(gathered, f"{schedule.name} (measured)")
    simulated = simulate_measured(schedule.compute_orders(), gathered, t_comm=t_comm)
    paths = [out / "pp_timeline.png", out / "pp_simulated.png", out / "pp_timeline.json"]
    measured.plot(paths[0], f"{schedule.name} measured: step {measured.makespan * 1e3:.2f} ms")
    simulated.plot(paths[1], f"{schedule.name} simulated: step {simulated.makespan * 1e3:.2f} ms")
    ranks = [
        {"rank": r, "busy_ms": busy * 1e3, "bubble_ms": (measured.makespan - busy) * 1e3}
        for r, busy in enumerate(measured.busy)
    ]
    report = {
        "schedule": schedule.name,
        "measured_step_ms": measured.makespan * 1e3,
        "simulated_step_ms": simulated.makespan * 1e3,
        "t_comm_ms": t_comm * 1e3,
        "ranks": ranks,
    }
    paths[2].write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"\npipeline ({schedule.name}), last profiled step: {measured.makespan * 1e3:.2f} ms measured, "
        f"{simulated.makespan * 1e3:.2f} ms simulated from the measured F/B/W means and a "
        f"{t_comm * 1e3:.3f} ms transfer"
    )
    for row in ranks:
        print(f"  rank {row['rank']}: busy {row['busy_ms']:.2f} ms, bubble {row['bubble_ms']:.2f} ms")
    return paths
