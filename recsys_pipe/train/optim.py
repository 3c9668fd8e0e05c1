"""Optimizers named in the config, mapped to torch (dense) and fbgemm-fused (embedding) ones."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torchrec.optim import RowWiseAdagrad

from recsys_pipe.config import OptimizerConfig, SparseOptimizerConfig


def dense_optimizer_factory(cfg: OptimizerConfig) -> Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]:
    """params -> optimizer for the dense (DDP) part of the model."""
    if cfg.name == "sgd":
        return lambda p: torch.optim.SGD(p, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.name == "adam":
        return lambda p: torch.optim.Adam(p, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        return lambda p: torch.optim.AdamW(p, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return lambda p: torch.optim.Adagrad(p, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay)


def sparse_optimizer(cfg: SparseOptimizerConfig) -> tuple[type, dict[str, Any]]:
    """(optimizer class, kwargs) that torchrec fuses into the sharded tables' backward."""
    if cfg.name == "sgd":
        return torch.optim.SGD, {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    if cfg.name == "adagrad":
        return torch.optim.Adagrad, {"lr": cfg.lr, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if cfg.name == "adam":
        return torch.optim.Adam, {"lr": cfg.lr, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    return RowWiseAdagrad, {"lr": cfg.lr, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
