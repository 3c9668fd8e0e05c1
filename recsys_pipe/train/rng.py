"""Random-number-generator states of one rank, as a checkpointable object.

Dropout (and any other random op) draws from torch's global generators, so a resumed run must
continue from the exact generator states of the step it resumes at. Python's `random` and
numpy's legacy global generator are saved too, for code that uses them. Values are stored as
tensors and plain Python objects so that a checkpoint loads without unpickling arbitrary types.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["RngState"]


class RngState:
    """`torch.distributed.checkpoint.stateful.Stateful` over this process's RNG states
    (torch CPU and, when used, CUDA; Python `random`; numpy's global generator)."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state(legacy=False)
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": {
                "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                "pos": int(np_state["state"]["pos"]),
                "has_gauss": int(np_state["has_gauss"]),
                "gauss": float(np_state["gauss"]),
            },
        }
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
        numpy = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": "MT19937",
                "state": {"key": numpy["key"].numpy().astype(np.uint32), "pos": numpy["pos"]},
                "has_gauss": numpy["has_gauss"],
                "gauss": numpy["gauss"],
            }
        )
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)
