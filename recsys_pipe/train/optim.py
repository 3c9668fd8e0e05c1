"""Optimizers (`optimizer.*`): the dense optimizer, picked by name from `OPTIMIZERS` (or
`optimizer.builder=pkg.module:function`, like models and data sources), the one fused into the
torchrec tables' backward (`optimizer.sparse`, a fixed choice of fbgemm kernels), and the dense
learning-rate schedule (a torch `LambdaLR`) and gradient-norm clipping, applied by
`TrainOptimizer.step`.

A dense optimizer is a builder and its config class:

    def build(cfg: MyOptimizerConfig, params) -> torch.optim.Optimizer

It updates every parameter that is not in a torchrec-sharded table (plain torch tables included).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, StrictInt, StrictStr

from recsys_pipe.config import Component, ConfigError, ConfigProblem, Registry, Section, builder_field

__all__ = [
    "OPTIMIZERS",
    "AdagradConfig",
    "AdamConfig",
    "AdamWConfig",
    "LrSchedule",
    "OptimizerConfig",
    "SGDConfig",
    "SparseOptimizerConfig",
    "TrainOptimizer",
    "dense_optimizer_factory",
    "sparse_optimizer",
    "CPU_FUSED",
    "check_sparse_device",
]

DenseFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


class SparseOptimizerConfig(Section):
    """Optimizer fused into the torchrec tables' backward (`optimizer.sparse.*`)."""

    name: Literal["sgd", "adagrad", "rowwise_adagrad", "adam"] = Field(
        "rowwise_adagrad", description="sgd | adagrad | rowwise_adagrad | adam"
    )
    lr: float = Field(0.01, gt=0, description="learning rate of the embedding tables")
    eps: float = Field(1e-8, gt=0, description="epsilon of adaptive optimizers")
    weight_decay: float = Field(0.0, ge=0, description="weight decay of the embedding tables")

    def state_elements(self, rows: int, cols: int) -> int:
        """Floats of fbgemm's state for a table shard of `rows` x `cols` under this optimizer."""
        per_entry = {"sgd": 0, "adagrad": 1, "adam": 2}
        return rows if self.name == "rowwise_adagrad" else per_entry[self.name] * rows * cols


class OptimizerConfig(Component):
    """What every dense optimizer config has (`optimizer.*`), plus the fused sparse one
    (`optimizer.sparse`). A builder whose config parameter is not annotated gets this class."""

    #: floats of optimizer state per parameter entry (the memory estimate's); a custom optimizer
    #: is assumed to keep two, as Adam does, unless its config class says otherwise
    state_copies: ClassVar[float] = 2

    lr: float = Field(1e-3, gt=0, description="dense learning rate")
    weight_decay: float = Field(0.0, ge=0, description="dense weight decay")
    sparse: SparseOptimizerConfig = Field(
        default_factory=SparseOptimizerConfig, description="optimizer fused into the torchrec tables"
    )
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="dense lr after warmup: constant | linear | cosine decay to min_lr_ratio * lr"
    )
    warmup_steps: StrictInt = Field(0, ge=0, description="dense lr rises linearly from lr/warmup_steps to lr")
    decay_steps: StrictInt | None = Field(
        None, ge=1, description="step at which linear/cosine decay ends (null: the run's last step)"
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final dense lr of linear/cosine decay, as a ratio of lr")
    clip_grad_norm: float | None = Field(
        None, gt=0, description="clip the dense gradients to this total L2 norm (null: no clipping)"
    )

    def build(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        """The dense optimizer over `params` (the builder's result)."""
        return self.call_builder("optimizer", params)


class SGDConfig(OptimizerConfig):
    """`optimizer=sgd`."""

    name: Literal["sgd"] = "sgd"
    builder: StrictStr | None = builder_field("recsys_pipe.train.optim:build_sgd")
    momentum: float = Field(0.0, ge=0, description="momentum")

    @property
    def state_copies(self) -> float:  # type: ignore[override]
        return 1 if self.momentum else 0


class AdamConfig(OptimizerConfig):
    """`optimizer=adam` (and `optimizer.name=adamw`)."""

    name: Literal["adam"] = "adam"
    builder: StrictStr | None = builder_field("recsys_pipe.train.optim:build_adam")
    betas: tuple[float, float] = Field((0.9, 0.999), description="moment decay rates")
    eps: float = Field(1e-8, gt=0, description="epsilon")


class AdamWConfig(AdamConfig):
    """`optimizer.name=adamw`: Adam with decoupled weight decay."""

    name: Literal["adamw"] = "adamw"
    builder: StrictStr | None = builder_field("recsys_pipe.train.optim:build_adamw")


class AdagradConfig(OptimizerConfig):
    """`optimizer.name=adagrad`."""

    state_copies: ClassVar[float] = 1

    name: Literal["adagrad"] = "adagrad"
    builder: StrictStr | None = builder_field("recsys_pipe.train.optim:build_adagrad")
    eps: float = Field(1e-10, gt=0, description="epsilon")


def build_sgd(cfg: SGDConfig, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


# Adam and AdamW run torch's fused kernel (`fused=True`, on the CPU as on CUDA): the same update
# as the default per-parameter loop, in one pass over each tensor instead of about ten, which
# matters for a large table on the dense kernel (SASRec's item table: 6.9 -> 1.1 ms per step,
# docs/benchmarks.md#sasrec). Its rounding differs from the loop's in the last bits.


def build_adam(cfg: AdamConfig, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True)


def build_adamw(cfg: AdamWConfig, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True)


def build_adagrad(cfg: AdagradConfig, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay)


#: Dense optimizers by name (`optimizer.name=...`): name -> import path of the config class.
OPTIMIZERS = Registry(
    "optimizer",
    OptimizerConfig,
    {
        "sgd": "recsys_pipe.train.optim:SGDConfig",
        "adam": "recsys_pipe.train.optim:AdamConfig",
        "adamw": "recsys_pipe.train.optim:AdamWConfig",
        "adagrad": "recsys_pipe.train.optim:AdagradConfig",
    },
)


def dense_optimizer_factory(cfg: OptimizerConfig) -> DenseFactory:
    """params -> optimizer for the dense part of the model."""
    return cfg.build


#: the fused optimizers fbgemm's CPU kernels implement (its `use_cpu` assertion in
#: `SplitTableBatchedEmbeddingBagsCodegen`; fbgemm-gpu-cpu 1.8)
CPU_FUSED = ("sgd", "adagrad", "rowwise_adagrad")


def check_sparse_device(cfg: SparseOptimizerConfig, device_type: str) -> None:
    """ConfigError at `optimizer.sparse.name` if fbgemm cannot fuse it into tables on `device_type`
    (checked before anything starts: fbgemm itself asserts while the model is sharded)."""
    if device_type == "cpu" and cfg.name not in CPU_FUSED:
        raise ConfigError(
            ConfigProblem(
                "optimizer.sparse.name",
                f"{cfg.name} is not fused into torchrec tables on the CPU (fbgemm's CPU kernels fuse "
                f"{', '.join(CPU_FUSED)}); pick one of those, or model.compute_kernel=dense to update the tables with "
                "the dense optimizer (e.g. optimizer=adam)",
            )
        )


def sparse_optimizer(cfg: SparseOptimizerConfig) -> tuple[type, dict[str, Any]]:
    """(optimizer class, kwargs) that torchrec fuses into the sharded tables' backward."""
    from torchrec.optim import RowWiseAdagrad

    classes = {
        "sgd": torch.optim.SGD,
        "adagrad": torch.optim.Adagrad,
        "adam": torch.optim.Adam,
        "rowwise_adagrad": RowWiseAdagrad,
    }
    kwargs: dict[str, Any] = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    if cfg.name != "sgd":
        kwargs["eps"] = cfg.eps
    return classes[cfg.name], kwargs


class LrSchedule:
    """The dense learning-rate factor of step `n` (0-based): linear warmup over `warmup_steps`,
    then constant, or linear/cosine decay from 1 to `min_lr_ratio` at `decay_steps`.

    A closed form (not a chain of schedulers) so that the factor of any step is exact whatever
    step a run resumes at; a class (not a closure) so it is picklable and readable.
    """

    def __init__(self, kind: str, warmup_steps: int, decay_steps: int, min_lr_ratio: float = 0.0):
        self.kind = kind
        self.warmup_steps = warmup_steps
        self.decay_steps = max(decay_steps, warmup_steps + 1)
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        if self.kind == "linear":
            decayed = 1.0 - progress
        else:
            decayed = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decayed


class TrainOptimizer:
    """The model's optimizer as the tasks use it: torchrec's combined optimizer (fused embedding
    part + dense part) for sharded models, the dense torch optimizer alone for plain ones.

    `step()` clips the dense network's gradients (`optimizer.clip_grad_norm`), steps, then
    advances the dense learning-rate schedule (torch `LambdaLR` over `LrSchedule`). Tables on the
    fused kernel keep their own fixed learning rate: their update is fused into backward. Tables
    on the dense kernel (`model.compute_kernel=dense`) are stepped and scheduled with the dense
    optimizer but never clipped: each rank holds other rows, so a norm over them would differ
    between ranks and so would the clipped replicas. `state_dict()` holds what a checkpoint needs:
    the optimizer state and the scheduler's; the state of a sharded table (e.g. its Adam moments)
    is a `ShardedTensor` laid out like the table, so DCP saves every rank's rows (and reshards),
    with torchrec's optimizer or a plain one. `flat_state`: the ranks hold different parameters
    (`Parallelism.flat_optimizer_state`), so the state is saved flattened, hyperparameters keyed
    by parameter name (DCP's default keeps one list of param groups, the same key on every rank,
    of which a checkpoint keeps one rank's).
    """

    def __init__(
        self, optimizer: Any, cfg: OptimizerConfig, total_steps: int, model: torch.nn.Module, flat_state: bool = False
    ):
        self.optimizer = optimizer
        self.model = model
        self.flat_state = flat_state
        #: torchrec's combined optimizer (keyed state, made loadable by `init_state`), or None
        self.keyed = hasattr(optimizer, "optimizers")
        if self.keyed:
            from torchrec.optim.keyed import KeyedOptimizerWrapper

            dense = [opt for _, opt in optimizer.optimizers if isinstance(opt, KeyedOptimizerWrapper)]
            if len(dense) != 1:
                raise TypeError(f"expected one dense optimizer in {optimizer!r}, found {len(dense)}")
            self.dense = dense[0]
        else:
            self.dense = optimizer
        #: the table parameters the dense optimizer updates, by key, with the table as the model's
        #: state_dict holds it (a ShardedTensor: the layout their optimizer state is saved in)
        params = dict(self.dense.params) if self.keyed else _named(self.dense, model)
        self.sharded_tables = _sharded_tables(params, model)
        tables = {id(params[key]) for key in self.sharded_tables}
        #: the state of tables without a shard on this rank, left out of `state_dict` (the ranks
        #: holding their rows save it) and put back by `load_state_dict`
        self._held: dict[str, Any] = {}
        #: the parameters gradient clipping covers: the dense network's
        self.dense_params = [p for group in self.dense.param_groups for p in group["params"] if id(p) not in tables]
        self.max_grad_norm = cfg.clip_grad_norm
        schedule = LrSchedule(cfg.schedule, cfg.warmup_steps, cfg.decay_steps or total_steps, cfg.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.dense, schedule)
        #: total dense gradient norm before clipping, of the last step (a tensor: reading it syncs)
        self.last_grad_norm: torch.Tensor | None = None
        #: the dense learning rate the last step used
        self.last_lr: float = self.lr

    @property
    def lr(self) -> float:
        """The dense learning rate of the next step."""
        return float(self.dense.param_groups[0]["lr"])

    def zero_grad(self) -> None:
        """Clear the gradients of every parameter the optimizer steps."""
        self.optimizer.zero_grad()

    def step(self) -> None:
        """Clip the dense gradients (`optimizer.clip_grad_norm`; the norm is kept in
        `last_grad_norm`), step the optimizer, then the LR schedule."""
        if self.max_grad_norm is not None:
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self.dense_params, self.max_grad_norm)
        self.last_lr = self.lr
        self.optimizer.step()
        self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        """Optimizer and scheduler state. A plain torch optimizer's goes through DCP's
        `get_optimizer_state_dict`: keyed by parameter name (not position) and with its lazily
        made state (e.g. Adam moments) created, so a checkpoint can be loaded into it in place."""
        if self.keyed:
            optim_state = self.optimizer.state_dict()
        else:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=self._dcp_options())
        self._held = {}
        for key, table in self.sharded_tables.items():
            if not table.local_shards():  # e.g. table_row_wise on another host: the ranks holding it save it
                self._held[key] = _pop_param_state(optim_state, key)
            else:
                _map_param_state(optim_state, key, lambda value, table=table: _like_table(value, table))
        return {"optimizer": optim_state, "lr_scheduler": self.scheduler.state_dict()}

    def prepare_load(self) -> None:
        """Create torchrec's dense optimizer's lazily made state so a checkpoint can be loaded
        into it in place (torchrec's `init_state`: one step on zero gradients; the parameters it
        might touch are then overwritten by the checkpoint's). Plain torch optimizers get theirs
        from `state_dict()`."""
        if self.keyed and not self.dense.state:
            self.dense.init_state()
            for p in self.dense_params:
                p.grad = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what `state_dict()` returned (after DCP loaded it into this optimizer's tensors) in place."""
        for key in self.sharded_tables:  # DCP loaded into the shards, which are the state's tensors
            if key in self._held:
                _put_param_state(state["optimizer"], key, self._held[key])
            else:
                _map_param_state(state["optimizer"], key, _local)
        if self.keyed:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=self._dcp_options())
        self.scheduler.load_state_dict(state["lr_scheduler"])
        # the scheduler restores its step, not the optimizer's lr: set the lr of the next step
        for group, lr in zip(self.dense.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr

    def _dcp_options(self) -> Any:
        """DCP's options for the optimizer state: flattened with `flat_state`, else DCP's default."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=self.flat_state)


def _named(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A plain optimizer's parameters by their name in `model`."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return {name: p for name, p in model.named_parameters() if id(p) in stepped}


def _sharded_tables(params: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, Any]:
    """The dense optimizer's parameters (`params`, by key) that the model's state_dict holds as
    a `ShardedTensor`: tables on torchrec's dense kernel. Each has at most one shard per rank."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    model_state = model.state_dict()
    tables = {key: model_state[key] for key in params if isinstance(model_state.get(key), ShardedTensor)}
    for key, table in tables.items():
        if len(table.local_shards()) > 1:
            raise NotImplementedError(
                f"table {key}: {len(table.local_shards())} shards on one rank; the dense kernel's optimizer state "
                "is saved for one shard per rank (use model.sharding=row_wise or table_wise)"
            )
    return tables


def _pop_param_state(optim_state: dict[str, Any], key: str) -> Any:
    """Remove parameter `key`'s state from an optimizer state dict, nested or flattened
    (`_map_param_state`), and return it."""
    if isinstance(optim_state.get("state"), dict):
        return optim_state["state"].pop(key, None)
    prefix = f"state.{key}."
    return {name: optim_state.pop(name) for name in [k for k in optim_state if k.startswith(prefix)]}


def _put_param_state(optim_state: dict[str, Any], key: str, held: Any) -> None:
    """Put back what `_pop_param_state` removed."""
    if held is None:
        return
    if isinstance(optim_state.get("state"), dict):
        optim_state["state"][key] = held
    else:
        optim_state.update(held)


def _like_table(value: Any, table: Any) -> Any:
    """`value` (a state tensor of a sharded table's local shard, e.g. an Adam moment) as a
    `ShardedTensor` with the table's layout, sharing `value`'s storage (so DCP loads in place);
    anything else (a step count) unchanged."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    shards = table.local_shards()
    if not isinstance(value, torch.Tensor) or value.shape != shards[0].tensor.shape:
        return value
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(value, shards[0].metadata)], table.metadata()
    )


def _local(value: Any) -> Any:
    """The local tensor of a `ShardedTensor` made by `_like_table`; anything else unchanged."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return value.local_shards()[0].tensor if isinstance(value, ShardedTensor) else value


def _map_param_state(optim_state: dict[str, Any], key: str, fn: Callable[[Any], Any]) -> None:
    """Replace each state value of parameter `key` (e.g. its Adam moments) by `fn(value)`, in an
    optimizer state dict nested (`state[key][name]`) or flattened by DCP (`state.<key>.<name>`,
    `TrainOptimizer.flat_state`)."""
    if isinstance(optim_state.get("state"), dict):
        moments = optim_state["state"].get(key, {})
        for name, value in moments.items():
            moments[name] = fn(value)
        return
    prefix = f"state.{key}."
    for name in [k for k in optim_state if k.startswith(prefix)]:
        optim_state[name] = fn(optim_state[name])
