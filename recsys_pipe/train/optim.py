"""Optimizers (`optimizer.*`): the dense optimizer, picked by name from `OPTIMIZERS` (or
`optimizer.builder=pkg.module:function`, like models and data sources), and the one fused into
the torchrec tables' backward (`optimizer.sparse`, a fixed choice of fbgemm kernels).

A dense optimizer is a builder and its config class:

    def build(cfg: MyOptimizerConfig, params) -> torch.optim.Optimizer

It updates every parameter that is not in a torchrec-sharded table (plain torch tables included).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from pydantic import Field, StrictStr

from recsys_pipe.config import Component, Registry, Section, builder_field

__all__ = [
    "OPTIMIZERS",
    "AdagradConfig",
    "AdamConfig",
    "AdamWConfig",
    "OptimizerConfig",
    "SGDConfig",
    "SparseOptimizerConfig",
    "dense_optimizer_factory",
    "sparse_optimizer",
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


class OptimizerConfig(Component):
    """What every dense optimizer config has (`optimizer.*`), plus the fused sparse one
    (`optimizer.sparse`). A builder whose config parameter is not annotated gets this class."""

    lr: float = Field(1e-3, gt=0, description="dense learning rate")
    weight_decay: float = Field(0.0, ge=0, description="dense weight decay")
    sparse: SparseOptimizerConfig = Field(
        default_factory=SparseOptimizerConfig, description="optimizer fused into the torchrec tables"
    )

    def build(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        """The dense optimizer over `params` (the builder's result)."""
        return self.builder_fn()(self, params)


class SGDConfig(OptimizerConfig):
    """`optimizer=sgd`."""

    name: Literal["sgd"] = "sgd"
    builder: StrictStr | None = builder_field("recsys_pipe.train.optim:build_sgd")
    momentum: float = Field(0.0, ge=0, description="momentum")


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

    name: Literal["adagrad"] = "adagrad"
    builder: StrictStr | None = builder_field("recsys_pipe.train.optim:build_adagrad")
    eps: float = Field(1e-10, gt=0, description="epsilon")


def build_sgd(cfg: SGDConfig, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def build_adam(cfg: AdamConfig, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def build_adamw(cfg: AdamWConfig, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


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
