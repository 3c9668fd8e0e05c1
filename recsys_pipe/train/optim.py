"""Optimizers (`optimizer.*`): the dense optimizer (torch) and the one fused into the sharded
embedding tables (fbgemm), each looked up by name; the dense learning-rate schedule (a torch
`LambdaLR`) and gradient-norm clipping, applied by `TrainOptimizer.step`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from pydantic import Field, StrictInt

from recsys_pipe.config import Section

__all__ = [
    "LrSchedule",
    "OptimizerConfig",
    "SparseOptimizerConfig",
    "TrainOptimizer",
    "dense_optimizer_factory",
    "sparse_optimizer",
]

DenseFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


class SparseOptimizerConfig(Section):
    """Optimizer fused into the sharded embedding tables' backward (`optimizer.sparse.*`)."""

    name: Literal["sgd", "adagrad", "rowwise_adagrad", "adam"] = Field(
        "rowwise_adagrad", description="sgd | adagrad | rowwise_adagrad | adam"
    )
    lr: float = Field(0.01, gt=0, description="learning rate of the embedding tables")
    eps: float = Field(1e-8, gt=0, description="epsilon of adaptive optimizers")
    weight_decay: float = Field(0.0, ge=0, description="weight decay of the embedding tables")


class OptimizerConfig(Section):
    """Dense optimizer (`optimizer.*`) plus the fused sparse one (`optimizer.sparse`)."""

    name: Literal["sgd", "adam", "adamw", "adagrad"] = Field("adam", description="sgd | adam | adamw | adagrad")
    lr: float = Field(1e-3, gt=0, description="dense learning rate")
    weight_decay: float = Field(0.0, ge=0, description="dense weight decay")
    momentum: float = Field(0.0, ge=0, description="sgd momentum")
    betas: tuple[float, float] = Field((0.9, 0.999), description="adam/adamw betas")
    eps: float = Field(1e-8, gt=0, description="epsilon of adaptive optimizers")
    sparse: SparseOptimizerConfig = Field(default_factory=SparseOptimizerConfig, description="embedding optimizer")
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


#: `optimizer.name` -> factory of the dense optimizer (the names are OptimizerConfig.name's choices).
DENSE_OPTIMIZERS: dict[str, Callable[[OptimizerConfig], DenseFactory]] = {
    "sgd": lambda c: lambda p: torch.optim.SGD(p, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay),
    "adam": lambda c: lambda p: torch.optim.Adam(p, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay),
    "adamw": lambda c: lambda p: torch.optim.AdamW(p, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay),
    "adagrad": lambda c: lambda p: torch.optim.Adagrad(p, lr=c.lr, eps=c.eps, weight_decay=c.weight_decay),
}


def dense_optimizer_factory(cfg: OptimizerConfig) -> DenseFactory:
    """params -> optimizer for the dense (DDP) part of the model."""
    return DENSE_OPTIMIZERS[cfg.name](cfg)


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
    """The model's combined optimizer (fused embedding part + dense part) as the tasks use it.

    `step()` clips the dense gradients (`optimizer.clip_grad_norm`), steps both parts, then
    advances the dense learning-rate schedule (torch `LambdaLR` over `LrSchedule`). The embedding
    tables keep their own fixed learning rate: their update is fused into backward.
    `state_dict()` holds what a checkpoint needs: both parts' state and the scheduler.
    """

    def __init__(self, optimizer: Any, cfg: OptimizerConfig, total_steps: int):
        from torchrec.optim.keyed import KeyedOptimizerWrapper

        self.optimizer = optimizer
        dense = [opt for _, opt in optimizer.optimizers if isinstance(opt, KeyedOptimizerWrapper)]
        if len(dense) != 1:
            raise TypeError(f"expected one dense optimizer in {optimizer!r}, found {len(dense)}")
        self.dense = dense[0]
        self.dense_params = [p for group in self.dense.param_groups for p in group["params"]]
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
        self.optimizer.zero_grad()

    def step(self) -> None:
        if self.max_grad_norm is not None:
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self.dense_params, self.max_grad_norm)
        self.last_lr = self.lr
        self.optimizer.step()
        self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "lr_scheduler": self.scheduler.state_dict()}

    def prepare_load(self) -> None:
        """Create the dense optimizer's lazily made state (e.g. Adam moments) so a checkpoint can
        be loaded into it in place (torchrec's `init_state`: one step on zero gradients; the
        parameters it might touch are then overwritten by the checkpoint's)."""
        if not self.dense.state:
            self.dense.init_state()
            for p in self.dense_params:
                p.grad = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        # the scheduler restores its step, not the optimizer's lr: set the lr of the next step
        for group, lr in zip(self.dense.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
