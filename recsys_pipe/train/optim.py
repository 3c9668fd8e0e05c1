"""Optimizers (`optimizer.*`): the dense optimizer (torch) and the one fused into the sharded
embedding tables (fbgemm), each looked up by name."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from pydantic import Field

from recsys_pipe.config import Section

__all__ = ["OptimizerConfig", "SparseOptimizerConfig", "dense_optimizer_factory", "sparse_optimizer"]

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
