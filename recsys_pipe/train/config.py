"""The run config: `TrainerConfig` (the training loop's settings) and `RunConfig`, which composes
every component's own config into what `recsys-train` runs.

Each section is owned by the code it configures: the plan by `recsys_pipe.config`, the data
source, model and dense optimizer by their registries (`data.name`, `model.name`,
`optimizer.name` -- or `*.builder` -- pick the config class), the loop by `TrainerConfig` here. `load_run_config`
validates them all and the constraints between them, and reports every problem with its config
path before anything is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import (
    Field,
    SerializeAsAny,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from recsys_pipe.config import (
    ConfigError,
    ConfigProblem,
    PlanConfig,
    Registry,
    Section,
    home_expanded,
    to_container,
    validate_section,
)
from recsys_pipe.config.errors import problems_from_validation_error
from recsys_pipe.data.registry import DATA_SOURCES
from recsys_pipe.data.source import DataConfig
from recsys_pipe.models.base import ModelConfig
from recsys_pipe.models.registry import MODELS
from recsys_pipe.train.checkpoint import CheckpointConfig
from recsys_pipe.train.grad_accumulation import GradAccumulationConfig, check_grad_accumulation
from recsys_pipe.train.optim import OPTIMIZERS, AdamConfig, OptimizerConfig
from recsys_pipe.train.parallel.config import ParallelConfig
from recsys_pipe.train.torch_compile import CompileOptions

__all__ = ["RunConfig", "TorchProfilerConfig", "TrainerConfig", "load_run_config"]

R = TypeVar("R", bound="RunConfig")


class TorchProfilerConfig(Section):
    """A torch.profiler trace of a window of training steps (`trainer.torch_profiler.*`)."""

    steps: list[StrictInt] | None = Field(
        None, description="[first, last] training steps to trace (1-based, inclusive); null: no trace"
    )

    @field_validator("steps")
    @classmethod
    def _window(cls, steps: list[int] | None) -> list[int] | None:
        if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            raise ValueError(f"must be [first, last] with 1 <= first <= last, got {steps}")
        return steps


class TrainerConfig(Section):
    """The training loop (`trainer.*`)."""

    epochs: StrictInt = Field(
        1, ge=1, description="passes over the training data (each reshuffled with data.seed + epoch)"
    )
    max_steps: StrictInt | None = Field(200, ge=1, description="stop after this many steps at most (null: all epochs)")
    log_every: StrictInt = Field(
        10, ge=1, description="summary line and metrics record (loss, samples/s, lr) every N steps"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: this rank's GPU if CUDA is visible")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto: nccl on CUDA, gloo on the CPU")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: autocast the model's forward to bfloat16 (CPU and CUDA); weights stay fp32"
    )
    eval_every: StrictInt = Field(
        50, ge=0, description="evaluate every N steps, at epoch ends, before step 1 and after the last (0: never)"
    )
    eval_epochs: StrictInt = Field(
        1, ge=0, description="evaluate at the end of every N-th epoch (0: not at epoch ends; eval_every still applies)"
    )
    eval_batches: StrictInt = Field(
        8, ge=0, description="held-out batches per rank (the tail of its share) for evaluation"
    )
    eval_dump: StrictStr | None = Field(
        None,
        min_length=1,
        description="retrieval models: CSV of the test ranks (user,item,rank_sampled,rank_full) of the evaluation "
        "with the best validation HR@10",
    )
    progress_bar: StrictBool = Field(True, description="tqdm bar on rank 0")
    output_dir: StrictStr = Field("runs", min_length=1, description="run directories go under here")
    tensorboard: StrictBool = Field(True, description="write TensorBoard event files into the run directory")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="when to save checkpoints")
    peer_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a collective that waits longer for a peer fails, and a rank silent this long is declared dead",
    )
    preemption_check_s: float = Field(
        0.5, ge=0, description="seconds between the ranks' checks for a SIGTERM (0: every step); a stop lags up to 2x"
    )
    verify_collectives: Literal["off", "startup", "always"] = Field(
        "startup",
        description="fail a task that issues a collective without nccl: true (startup: first iterations only)",
    )
    resume_from: StrictStr | None = Field(
        None,
        min_length=1,
        description="continue from a checkpoint dir, a run dir (its newest checkpoint) or 'latest' (under output_dir)",
    )
    torch_profiler: TorchProfilerConfig = Field(
        default_factory=TorchProfilerConfig, description="torch.profiler trace of some steps (<run dir>/torch_trace/)"
    )

    _home = field_validator("output_dir", "eval_dump", "resume_from")(home_expanded)
    grad_accumulation: GradAccumulationConfig = Field(
        default_factory=GradAccumulationConfig,
        description="micro-batches per optimizer step, DDP no_sync between (torchrec's GradientAccumulationWrapper)",
    )
    compile: StrictBool = Field(
        False,
        description="torch.compile the model's dense modules (its torchrec tables stay torchrec's), under any plan",
    )
    compile_options: CompileOptions = Field(
        default_factory=CompileOptions, description="torch.compile's options for trainer.compile=true"
    )
    dense_ddp: Literal["torch", "megatron"] = Field(
        "torch",
        description="data parallelism of the replicated (dense) part: torch: torch DDP, gradients all-reduced during "
        "backward; megatron: megatron-core's DDP (CUDA only; models with plain torch tables), gradients reduced by the "
        "finalize_model_grads task",
    )

    @model_validator(mode="after")
    def _accumulation_fits(self) -> TrainerConfig:
        check_grad_accumulation(self.grad_accumulation, self.checkpoint.interval, self.dense_ddp)
        return self

    @model_validator(mode="after")
    def _profiled_steps_run(self) -> TrainerConfig:
        steps = self.torch_profiler.steps
        if steps is not None and self.max_steps is not None and steps[1] > self.max_steps:
            raise ConfigError(
                ConfigProblem(
                    "trainer.torch_profiler.steps",
                    f"the window {steps} ends after the last step (trainer.max_steps={self.max_steps}): "
                    "nothing would be traced",
                )
            )
        return self


class RunConfig(Section):
    """Everything `recsys-train` needs, as composed by Hydra from conf/config.yaml."""

    pipeline: PlanConfig = Field(description="the plan: tasks, streams, lookaheads, threads, dependencies")
    model: SerializeAsAny[ModelConfig] = Field(description="the model; model.name picks its config and builder")
    data: SerializeAsAny[DataConfig] = Field(description="the data source; data.name picks it")
    optimizer: SerializeAsAny[OptimizerConfig] = Field(
        default_factory=AdamConfig, description="dense and embedding optimizers; optimizer.name picks the dense one"
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="the training loop")
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig, description="how the model is spread over ranks beyond data parallelism"
    )
    seed: StrictInt = Field(0, description="model initialisation seed")
    debug: StrictBool = Field(False, description="show tracebacks for errors instead of one-line messages")

    #: sections whose config class is picked by their `name` from a registry (or their `builder`)
    COMPONENTS: ClassVar[dict[str, Registry]] = {"model": MODELS, "data": DATA_SOURCES, "optimizer": OPTIMIZERS}

    @classmethod
    def from_container(cls: type[R], data: Any) -> R:
        """Validate a plain mapping (the composed config); ConfigError lists every problem."""
        if not isinstance(data, Mapping):
            raise ConfigError(ConfigProblem("", f"the config must be a mapping, got {type(data).__name__}"))
        sections = {k: v for k, v in data.items() if k != "hydra"}
        problems: list[ConfigProblem] = []
        failed: set[str] = set()
        for key, registry in cls.COMPONENTS.items():
            raw = sections.get(key)
            if not isinstance(raw, Mapping):
                continue  # missing or not a mapping: reported by the model validation below
            try:
                sections[key] = validate_section(registry.config_class(raw, key), raw, key)
            except ConfigError as exc:
                problems += exc.problems
                failed.add(key)
                del sections[key]
        run = None
        try:
            run = cls.model_validate(sections)
        except ValidationError as exc:
            problems += [p for p in problems_from_validation_error(exc, cls) if _section(p.path) not in failed]
        if run is not None:
            kind = type(run.model).data_kind
            try:  # a source that serves several kinds of model, as this model reads it
                run.data = run.data.as_kind(kind) if kind is not None else run.data
            except ConfigError as exc:
                problems += exc.problems
            else:
                problems += run.model.check_data(run.data)
        if run is not None and not problems:
            run.data = run.model.data_for_model(run.data)  # what the model derives for its data
        if problems:
            raise ConfigError(problems)
        assert run is not None
        return run


def load_run_config(cfg: Any, model: type[R] = RunConfig) -> R:  # type: ignore[assignment]
    """Validate the Hydra-composed config into a run config.

    `compile_plan(run.pipeline)` then checks the plan as a task graph.

    Args:
        cfg: the composed config (DictConfig or mapping).
        model: the run config class (`RunConfig`, or a subclass).

    Returns:
        The validated run config. Raises ConfigError with one problem per field error and per
        broken cross-section constraint."""
    return model.from_container(to_container(cfg))


def _section(path: str) -> str:
    return path.split(".", 1)[0].split("[", 1)[0]
