"""The random streams of one rank, each drawn by one concern only, and their checkpointed state.

Training must not depend on what else ran in between (an evaluation, a library, a data loader
creating its iterator): every random draw of a training step comes from a stream that nothing
else draws from.

* dropout: the model's `Dropout` sites draw from a `DropoutRng` of their own
  (`recsys_pipe.models.dropout`), seeded from `seed` (alike on every rank, as torch's global
  generator is); checkpointed.
* data order and training negatives: functions of `(data.seed, epoch, sample)`
  (`recsys_pipe.data.source`, `recsys_pipe.data.in_memory.sequences`), so their state is the data
  position, which the checkpoint's progress holds.
* evaluation: `RngState.evaluation(step)` runs an evaluation on torch's, Python's and numpy's
  global generators seeded from `(seed, step)`, and gives them back to training as they were,
  so anything random in an evaluation (a library, a loader) is reproducible and leaves
  training's draws alone. Evaluation's own negatives are seeded per user (`data.sequences`).
* torch's, Python's and numpy's global generators: whatever else draws (a custom model's
  `nn.Dropout`, a library) keeps drawing from them; checkpointed.

Values are stored as tensors and plain Python objects so that a checkpoint loads without
unpickling arbitrary types.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from recsys_pipe.models.dropout import DropoutRng

__all__ = ["RngState"]

#: stream numbers for `_stream_seed`: one per concern that seeds a generator from the run's seed
DROPOUT_STREAM, EVALUATION_STREAM = 1, 2


def _stream_seed(seed: int, stream: int, *counters: int) -> int:
    """A 63-bit seed for `stream` of the run seeded `seed` (numpy's `SeedSequence`: different
    streams and counters give unrelated seeds, unlike `seed + k`)."""
    return int(np.random.SeedSequence([seed, stream, *counters]).generate_state(1, np.uint64)[0] >> 1)


class RngState:
    """This rank's random streams (see the module docstring) and a
    `torch.distributed.checkpoint.stateful.Stateful` over them: the dropout generators, torch's
    CPU and (when used) CUDA global generators, Python `random` and numpy's global generator.

    `seed_globals()` seeds Python's and numpy's global generators (torch's is seeded where the
    model is built); `attach(model)` makes the model's dropout draw from this rank's dropout
    stream.
    """

    def __init__(self, seed: int, device: torch.device):
        self.seed = seed
        self.device = device
        self.dropout = DropoutRng(_stream_seed(seed, DROPOUT_STREAM))

    def seed_globals(self) -> None:
        """Python and numpy draw from OS entropy unless seeded."""
        random.seed(self.seed)
        np.random.seed(self.seed % 2**32)

    def attach(self, model: nn.Module) -> int:
        """Every `Dropout` site of `model` draws from this rank's dropout stream; returns how
        many sites it has."""
        return self.dropout.attach(model)

    @contextmanager
    def evaluation(self, step: int) -> Iterator[None]:
        """Evaluate on the global generators seeded from `(seed, step)`; training's global
        generator states are back when the block ends (see the module docstring)."""
        saved = self._global_state()
        eval_seed = _stream_seed(self.seed, EVALUATION_STREAM, step)
        try:
            torch.default_generator.manual_seed(eval_seed)
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    torch.cuda.manual_seed(eval_seed)
            random.seed(eval_seed)
            np.random.seed(eval_seed % 2**32)
            yield
        finally:
            self._load_global_state(saved)

    def state_dict(self) -> dict[str, Any]:
        """Every generator's state: torch's, Python's, numpy's (CUDA's where present) and the dropout stream's."""
        return {**self._global_state(), "dropout": self.dropout.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved; a state without `dropout` starts a fresh dropout stream."""
        self._load_global_state(state)
        self.dropout.load_state_dict(state.get("dropout", {}))

    def _global_state(self) -> dict[str, Any]:
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

    def _load_global_state(self, state: dict[str, Any]) -> None:
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
