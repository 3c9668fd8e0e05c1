"""Dropout whose masks come from a generator of its own (`DropoutRng`), not torch's global one.

`nn.Dropout` draws its masks from torch's global generator, which anything else in the process
may draw from too: an evaluation between two training steps, a library, a data loader creating
its iterator. Each such draw shifts every later mask, so training would depend on when (and
whether) something else ran. The models' dropout sites are `Dropout` modules instead: their
masks come from the `DropoutRng` attached to the model (`DropoutRng.attach`), which nothing but
dropout draws from and which a checkpoint saves (`recsys_pipe.train.rng`). A model used without
one (a unit test, a script) draws from torch's default generator, as `nn.Dropout` does.

The mask has `F.dropout`'s distribution (each element kept with probability `1 - p`, kept ones
scaled by `1 / (1 - p)`) but is drawn from random bits compared with a threshold (`keep_mask`)
rather than by `bernoulli_`: torch's CPU `bernoulli_` draws one double per element, 4-12 ms
for one of SASRec's 320,000-element masks against 0.4 ms here (docs/benchmarks.md, SASRec).
Every site knows its index among the model's dropout sites (`Dropout.site`), so the generator
can be chosen per site.

**The site key of pipelined models** (what follows `Dropout` below): masks that depend on
(step, microbatch, layer), never on where the layer runs.

A pipelined run must equal the one-process run bitwise with dropout on. One stream of masks
cannot give that: how many masks precede a layer's depends on which stages share the rank and
in which order the schedule runs the microbatches. The models' dropout sites draw from the
`DropoutRng` attached to them; for a model cut into stages that is `MICROBATCH_DROPOUT`, whose
generator for a site is a fresh one seeded by the step, the microbatch and the site's layer
index in the whole model, so a layer draws the same mask wherever and whenever it runs.

The stage runtime sets the (step, microbatch) key around each forward with `microbatch_seed`.
Outside such a block (evaluation, or a model run without the pipeline runtime) a training-mode
site keyed this way refuses to draw rather than silently drawing unreproducible masks.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import nn

__all__ = [
    "MICROBATCH_DROPOUT",
    "Dropout",
    "DropoutRng",
    "MicrobatchDropoutRng",
    "current_microbatch_seed",
    "dropout",
    "keep_mask",
    "microbatch_seed",
    "seeded_dropout",
]


#: signed integer dtypes by width in bits, the views of the random words a mask compares
_WORDS = {8: torch.int8, 16: torch.int16, 32: torch.int32}


def _threshold(keep: float) -> tuple[int, int]:
    """(bits per element, threshold t): an element is kept when its `bits` uniform random bits,
    read as an unsigned integer u, have u < t, so with probability t / 2**bits. The fewest bits
    that give `keep` exactly (p = 0.5: 8 bits); otherwise 32 bits with t = round(keep * 2**32),
    within 2**-32 of `keep` (finer than the float32 uniform `torch.rand` draws)."""
    for bits in (8, 16):
        scaled = keep * 2**bits
        if scaled == int(scaled):
            return bits, int(scaled)
    return 32, min(max(round(keep * 2**32), 0), 2**32 - 1)


def keep_mask(shape: torch.Size, keep: float, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """A bool tensor of `shape`, each element True with probability `keep` (see `_threshold`),
    independently, drawn from `generator`.

    Written by hand because torch has no cheap Bernoulli sampler on the CPU: `bernoulli_` and
    `rand` draw a float per element. Here one full-range `random_` over int64 words yields 64
    random bits per word (two 32-bit draws of the generator), viewed as 8-, 16- or 32-bit
    signed integers s; u = s + 2**(bits-1) is uniform on [0, 2**bits), so u < t reads as
    s < t - 2**(bits-1).
    """
    bits, threshold = _threshold(keep)
    n = shape.numel()
    words = torch.empty((n * bits + 63) // 64, dtype=torch.int64, device=device)
    words.random_(-(2**63), None, generator=generator)
    return (words.view(_WORDS[bits])[:n] < threshold - 2 ** (bits - 1)).view(shape)


def dropout(x: torch.Tensor, p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """`F.dropout(x, p, training=True)`'s distribution with the mask drawn from `generator`
    (torch's default generator of `x`'s device when None) by `keep_mask`: each element kept with
    probability `1 - p` and scaled by `1 / (1 - p)`; `p == 0` returns `x` itself."""
    if p == 0:
        return x
    if p == 1:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    noise = keep_mask(x.shape, 1 - p, generator, x.device).to(x.dtype)
    noise.div_(1 - p)
    return x * noise


class DropoutRng:
    """The generator every `Dropout` site of a model draws its masks from: one per device type
    (a rank computes on one device), seeded with `seed`; checkpointable (`state_dict` /
    `load_state_dict`).

    `generator(device, site)` is the one place a mask's generator is chosen: one stream for all
    sites today, drawn in the order the forward visits them.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}
        #: loaded states of generators not made yet (made on the first mask on their device)
        self._loaded: dict[str, torch.Tensor] = {}

    def generator(self, device: torch.device, site: int) -> torch.Generator:
        """The generator for the mask of dropout site `site` on `device`."""
        g = self._generators.get(device.type)
        if g is None:
            g = torch.Generator(device=device)
            state = self._loaded.pop(device.type, None)
            if state is None:
                g.manual_seed(self.seed)
            else:
                g.set_state(state)
            self._generators[device.type] = g
        return g

    def attach(self, model: nn.Module) -> int:
        """Make every `Dropout` module of `model` draw from this generator, numbering the sites
        in module order; returns how many there are."""
        sites = [m for m in model.modules() if isinstance(m, Dropout)]
        for index, module in enumerate(sites):
            module.rng, module.site = self, index
        return len(sites)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Per device type, the state of its generator (once it drew a mask)."""
        return {**self._loaded, **{kind: g.get_state() for kind, g in self._generators.items()}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore generator states saved by `state_dict`; each is applied when its device type next draws."""
        self._generators = {}
        self._loaded = dict(state)


class Dropout(nn.Module):
    """`nn.Dropout(p)` drawing its masks from the attached `DropoutRng` (see the module
    docstring); identity in eval mode and for `p == 0`."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0 <= p <= 1:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p
        #: set by `DropoutRng.attach`; without one, torch's default generator
        self.rng: DropoutRng | None = None
        self.site = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return dropout(x, self.p, self.rng.generator(x.device, self.site) if self.rng is not None else None)

    def extra_repr(self) -> str:
        return f"p={self.p}"


# -- the site key of pipelined models ------------------------------------------------------------

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
