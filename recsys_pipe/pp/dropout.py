"""Dropout masks that depend on (step, microbatch, layer), never on where the layer runs.

A pipelined run must equal the one-process run bitwise with dropout on. One stream of masks
cannot give that: how many masks precede a layer's depends on which stages share the rank and
in which order the schedule runs the microbatches. The models' dropout sites are
`recsys_pipe.models.dropout.Dropout` modules, which draw from the `DropoutRng` attached to them;
here that is `MICROBATCH_DROPOUT`, whose generator for a site is a fresh one seeded by the step,
the microbatch and the site's layer index in the whole model, so a layer draws the same mask
wherever and whenever it runs.

The stage runtime sets the (step, microbatch) key around each forward with `microbatch_seed`.
Outside such a block (evaluation, or a model run without the pipeline runtime) a training-mode
site keyed this way refuses to draw rather than silently drawing unreproducible masks.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from recsys_pipe.models.dropout import Dropout, DropoutRng

__all__ = ["MICROBATCH_DROPOUT", "MicrobatchDropoutRng", "current_microbatch_seed", "microbatch_seed", "seeded_dropout"]

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


class MicrobatchDropoutRng(DropoutRng):
    """The `DropoutRng` of pipelined models: the generator of site `site` is seeded by the
    innermost `microbatch_seed` key (base seed, step, microbatch) and the site. Nothing to
    checkpoint: a mask is a function of its key, and the step is saved with the model."""

    def __init__(self) -> None:
        super().__init__(seed=0)

    def generator(self, device: torch.device, site: int) -> torch.Generator:
        """A fresh generator for the mask of `site` in the current microbatch's key."""
        key = _CONTEXT.get()
        if key is None:
            raise RuntimeError(
                f"dropout site {site} ran in training mode outside microbatch_seed(step, microbatch): "
                "its mask would not be reproducible"
            )
        return torch.Generator(device=device).manual_seed(_mix(*key, site))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Empty: the masks follow from the keys."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to restore (see `state_dict`)."""


#: the one keyed generator every pipelined dropout site draws from
MICROBATCH_DROPOUT = MicrobatchDropoutRng()


def seeded_dropout(module: Dropout | float, layer: int) -> Dropout:
    """Key dropout site `module` (or a new `Dropout(p)`) by layer index `layer` of the whole
    model: its masks then come from `MICROBATCH_DROPOUT`."""
    site = module if isinstance(module, Dropout) else Dropout(module)
    site.rng, site.site = MICROBATCH_DROPOUT, int(layer)
    return site
