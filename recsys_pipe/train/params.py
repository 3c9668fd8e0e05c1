"""This rank's view of a sharded model's parameters, for parity checks and checkpoints' tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor


def local_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of every dense tensor and every local shard of each sharded table
    (`name#shard<j>`), so two training runs can be compared exactly on each rank."""
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            for j, shard in enumerate(value.local_shards()):
                out[f"{name}#shard{j}"] = shard.tensor.detach().clone()
        else:
            out[name] = value.detach().clone()
    return out
