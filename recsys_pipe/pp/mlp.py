"""A stack of Linear + ReLU + dropout layers with a regression head, split into stages: the model
of the pipeline-parallel parity tests and of the schedule benchmark.

Small enough to check bitwise, wide enough (`width`) for a benchmark's forward to dominate the
transfers, and plain torch, so torch.distributed.pipelining's own schedule classes can run the
same stages (`TorchStageAdapter`) for comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from recsys_pipe.models.dropout import microbatch_seed, seeded_dropout

__all__ = ["MLPStage", "TorchStageAdapter", "mlp_stages"]


class MLPStage(nn.Module):
    """Layers `layers` (global indices) of the stack; the last stage adds the head and the MSE
    loss against `batch["y"]`, the first reads `batch["x"]`."""

    def __init__(self, width: int, layers: Sequence[int], first: bool, last: bool, dropout: float = 0.0):
        super().__init__()
        self.first, self.last, self.indices = first, last, tuple(layers)
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.ReLU(), seeded_dropout(dropout, layer=i)) for i in layers]
        )
        self.head = nn.Linear(width, 1) if last else None

    def body(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's layers (and head): what torch's PipelineStage runs."""
        h = self.layers(x)
        return self.head(h) if self.head is not None else h

    def forward(self, batch: dict[str, torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        out = self.body(batch["x"] if self.first else inputs[0])
        return F.mse_loss(out, batch["y"]) if self.last else out

    def named_by_layer(self) -> dict[str, nn.Parameter]:
        """Parameters named by their layer in the whole stack (`layer2.weight`, `head.bias`), so
        every split of the stack names them alike."""
        out: dict[str, nn.Parameter] = {}
        for k, i in enumerate(self.indices):
            out[f"layer{i}.weight"], out[f"layer{i}.bias"] = self.layers[k][0].weight, self.layers[k][0].bias
        if self.head is not None:
            out["head.weight"], out["head.bias"] = self.head.weight, self.head.bias
        return out


def mlp_stages(width: int, split: Sequence[Sequence[int]], dropout: float = 0.0, seed: int = 0) -> list[MLPStage]:
    """The stack split as `split` (layer indices per stage); the same initial values whatever the
    split, since layers are created in order from one seed."""
    torch.manual_seed(seed)
    return [MLPStage(width, layers, s == 0, s == len(split) - 1, dropout) for s, layers in enumerate(split)]


class TorchStageAdapter(nn.Module):
    """A stage as torch's `PipelineStage` calls it, `forward(x)` (the loss goes to the
    schedule's `loss_fn`). torch's schedules run a stage's forwards in microbatch order, so a
    counter (reset by `begin_step`) gives the dropout key."""

    def __init__(self, stage: MLPStage):
        super().__init__()
        self.stage, self.step, self.count = stage, 0, 0

    def begin_step(self, step: int) -> None:
        """Key the dropout of the coming microbatches by `step`, counting them from 0."""
        self.step, self.count = step, 0

    def forward(self, x: torch.Tensor) -> Any:
        with microbatch_seed(self.step, self.count):
            self.count += 1
            return self.stage.body(x)
