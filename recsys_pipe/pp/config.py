"""The `parallel.pp` config section: how many pipeline stages, which schedule, how many
microbatches, and how the model's layers are split over the stages.

`data.batch_size` stays the batch of one data-parallel replica: it is cut into
`parallel.pp.microbatches` microbatches, and the world is `parallel.pp.size` x the
data-parallel size. Every constraint is checked before any process group starts and reported
as a ConfigError naming its key (exit 2): inside the section by the validator below, against
the model, the data and the world size by `check_pipeline_parallel`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictInt, StrictStr, model_validator

from recsys_pipe.config import ConfigError, ConfigProblem, Section
from recsys_pipe.models.base import ShardedModelConfig
from recsys_pipe.pp.schedules import NAMED_SCHEDULES, ResolvedSchedule, resolve_schedule

__all__ = [
    "PipelineParallelConfig",
    "check_pipeline_parallel",
    "check_training",
    "pipelined_tables",
    "split_layers",
]

PATH = "parallel.pp"


class PipelineParallelConfig(Section):
    """Pipeline parallelism (`parallel.pp.*`): the model split into stages over ranks."""

    size: StrictInt = Field(1, ge=1, description="pipeline stages, one per rank (world = size x data-parallel size)")
    microbatches: StrictInt | None = Field(
        None, ge=1, description="microbatches per step, each data.batch_size / microbatches samples (null: size)"
    )
    schedule: StrictStr = Field(
        "1f1b",
        min_length=1,
        description=f"per-rank order of forwards and backwards: {' | '.join(NAMED_SCHEDULES)}, or a schedule CSV "
        "in torch's format (one row per rank, actions like 0F1, 0I1, 0W1)",
    )
    stages_per_rank: StrictInt | None = Field(
        None, ge=1, description="stages on each rank (null: 1; 2 for interleaved_1f1b, zbv, dualpipev; a CSV's own)"
    )
    layers: list[StrictInt] | None = Field(
        None, description="layers of each stage, first to last (null: as even as possible, the first stages larger)"
    )

    def resolved(self) -> ResolvedSchedule:
        """What every rank runs (reads a CSV schedule again); ConfigError naming the key."""
        return resolve_schedule(self.schedule, self.size, self.num_microbatches, self.stages_per_rank)

    @property
    def enabled(self) -> bool:
        """Whether the run trains through pipeline stages (several stages, or microbatches)."""
        return self.size > 1 or self.num_microbatches > 1 or self.resolved().num_stages > 1

    @property
    def num_microbatches(self) -> int:
        """`microbatches`, or one per stage rank when it is null."""
        return self.size if self.microbatches is None else self.microbatches

    @model_validator(mode="after")
    def _fits(self) -> PipelineParallelConfig:
        problems = []
        if self.size > 1 and self.num_microbatches < self.size:
            problems.append(
                ConfigProblem(
                    f"{PATH}.microbatches",
                    f"{self.num_microbatches} microbatch(es) cannot fill {self.size} stages: need at least "
                    f"parallel.pp.size={self.size}",
                )
            )
        if problems:
            raise ConfigError(problems)
        num_stages = self.resolved().num_stages
        if self.layers is not None:
            if len(self.layers) != num_stages:
                problems.append(
                    ConfigProblem(f"{PATH}.layers", f"lists {len(self.layers)} stage(s), the schedule has {num_stages}")
                )
            elif min(self.layers) < 1:
                problems.append(
                    ConfigProblem(f"{PATH}.layers", f"every stage needs at least one layer, got {self.layers}")
                )
        if problems:
            raise ConfigError(problems)
        return self


def split_layers(num_layers: int, num_stages: int, explicit: list[int] | None = None) -> list[range]:
    """The layer indices of each stage: `explicit` counts, or as even as possible with the
    first `num_layers % num_stages` stages one layer larger."""
    if explicit is None:
        base, extra = divmod(num_layers, num_stages)
        explicit = [base + (s < extra) for s in range(num_stages)]
    if len(explicit) != num_stages or sum(explicit) != num_layers or min(explicit) < 1:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages as {explicit}")
    starts = [sum(explicit[:s]) for s in range(num_stages)]
    return [range(start, start + count) for start, count in zip(starts, explicit, strict=True)]


def pipelined_tables(model: ShardedModelConfig) -> ShardedModelConfig:
    """`model`'s config as a pipelined run shards its tables: on torchrec's dense kernel, whatever
    `model.compute_kernel` says (why: `recsys_pipe.pp.train.shard_tables`)."""
    return model.model_copy(update={"compute_kernel": "dense"})


def check_pipeline_parallel(run: Any, world_size: int) -> None:
    """The constraints of `parallel.pp` against the model, the data and the world size;
    ConfigError naming the key. `run` is the validated RunConfig."""
    pp: PipelineParallelConfig = run.parallel.pp
    if not pp.enabled:
        return
    problems = []
    if world_size % pp.size:
        problems.append(
            ConfigProblem(f"{PATH}.size", f"{pp.size} pipeline ranks do not divide the world of {world_size} rank(s)")
        )
    split = run.model.stage_split
    if split is None:
        problems.append(
            ConfigProblem(
                f"{PATH}.size",
                f"model '{run.model.name}' cannot be split into stages (its config declares no stage_split)",
            )
        )
    else:
        layers_field, num_layers = split.layers, run.model.stage_layers
        if pp.layers is not None and sum(pp.layers) != num_layers:
            problems.append(
                ConfigProblem(
                    f"{PATH}.layers",
                    f"{pp.layers} adds up to {sum(pp.layers)} layers, model.{layers_field}={num_layers}",
                )
            )
        elif num_layers < (num_stages := pp.resolved().num_stages):
            problems.append(
                ConfigProblem(
                    f"{PATH}.size",
                    f"{num_stages} stages need at least {num_stages} layers, model.{layers_field}={num_layers}",
                )
            )
    if run.data.batch_size % pp.num_microbatches:
        problems.append(
            ConfigProblem(
                f"{PATH}.microbatches",
                f"{pp.num_microbatches} microbatches do not divide data.batch_size={run.data.batch_size}",
            )
        )
    if problems:
        raise ConfigError(problems)
    check_training(run)


def check_training(run: Any) -> None:
    """What a pipelined run cannot do yet; ConfigError naming the key."""
    cfg, problems = run.trainer, []
    if run.optimizer.clip_grad_norm is not None:
        problems.append(
            ConfigProblem("optimizer.clip_grad_norm", "clipping over pipeline stages is not supported yet (use null)")
        )
    if isinstance(run.model, ShardedModelConfig) and run.model.sharding == "planner":
        problems.append(
            ConfigProblem(
                "model.sharding",
                "table_wise or row_wise with parallel.pp: the first stage's tables train on torchrec's dense kernel, "
                "which torchrec's planner does not offer",
            )
        )
    if getattr(run.model, "loss_normalization", "local") != "local":
        problems.append(ConfigProblem("model.loss_normalization", "only local with parallel.pp"))
    if cfg.grad_accumulation.enabled:
        problems.append(ConfigProblem("trainer.grad_accumulation.steps", "1 with parallel.pp (microbatches instead)"))
    if cfg.precision != "fp32":
        problems.append(ConfigProblem("trainer.precision", "fp32 with parallel.pp for now"))
    if cfg.compile:
        problems.append(
            ConfigProblem(
                "trainer.compile",
                "not with parallel.pp yet: the stages run the model's layers one by one, not its dense modules",
            )
        )
    if problems:
        raise ConfigError(problems)
