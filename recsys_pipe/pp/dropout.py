"""Dropout whose mask depends on (step, microbatch, layer), never on where the layer runs.

A pipelined run must equal the one-process run bitwise with dropout on. torch's global RNG
cannot give that: each rank draws from its own generator, and how many draws precede a layer
depends on which stages share the rank and in which order the schedule runs the microbatches.
Here every mask comes from a fresh generator seeded by the step, the microbatch and the layer's
global index, so a layer draws the same mask wherever and whenever it runs.

The stage runtime sets the (step, microbatch) context around each forward with
`microbatch_seed`; `SeededDropout` layers read it. Outside such a context (evaluation, or a
model run without the pipeline runtime) a training-mode `SeededDropout` refuses to run rather
than silently drawing unreproducible masks.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["SeededDropout", "current_microbatch_seed", "microbatch_seed"]

_CONTEXT: contextvars.ContextVar[tuple[int, int, int] | None] = contextvars.ContextVar(
    "recsys_pipe_pp_microbatch_seed", default=None
)

# SplitMix64-style mixing of the key's fields: neighbouring (step, microbatch, layer) keys give
# unrelated seeds, so consecutive layers or microbatches never share a mask by accident.
_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & _MASK64
        state ^= state >> 29
    return state & ((1 << 63) - 1)


@contextlib.contextmanager
def microbatch_seed(step: int, microbatch: int, base_seed: int = 0) -> Iterator[None]:
    """Within this block, `SeededDropout` layers draw the masks of (`step`, `microbatch`)."""
    token = _CONTEXT.set((base_seed, step, microbatch))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_microbatch_seed() -> tuple[int, int, int] | None:
    """The (base seed, step, microbatch) set by the innermost `microbatch_seed`, or None."""
    return _CONTEXT.get()


class SeededDropout(nn.Module):
    """`nn.Dropout(p)` whose mask is drawn from a generator seeded by (base seed, step,
    microbatch, `layer`); `layer` is the layer's index in the whole model, not in its stage."""

    def __init__(self, p: float, layer: int):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = float(p)
        self.layer = int(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        key = _CONTEXT.get()
        if key is None:
            raise RuntimeError(
                f"SeededDropout(layer={self.layer}) ran in training mode outside microbatch_seed(step, "
                "microbatch): its mask would not be reproducible"
            )
        generator = torch.Generator(device=x.device).manual_seed(_mix(*key, self.layer))
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=generator)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}"
