"""Dropout whose masks come from a generator of its own (`DropoutRng`), not torch's global one.

`nn.Dropout` draws its masks from torch's global generator, which anything else in the process
may draw from too: an evaluation between two training steps, a library, a data loader creating
its iterator. Each such draw shifts every later mask, so training would depend on when (and
whether) something else ran. The models' dropout sites are `Dropout` modules instead: their
masks come from the `DropoutRng` attached to the model (`DropoutRng.attach`), which nothing but
dropout draws from and which a checkpoint saves (`recsys_pipe.train.rng`). A model used without
one (a unit test, a script) draws from torch's default generator, as `nn.Dropout` does.

The mask is drawn and applied exactly as `F.dropout` does it on the CPU (`bernoulli_(1 - p)`,
divided by `1 - p`, multiplied in): given the same generator state, the output is the same bits.
Every site knows its index among the model's dropout sites (`Dropout.site`), so the generator
can be chosen per site.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Dropout", "DropoutRng", "dropout"]


def dropout(x: torch.Tensor, p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """`F.dropout(x, p, training=True)` with the mask drawn from `generator` (torch's default
    generator of `x`'s device when None): each element kept with probability `1 - p` and scaled
    by `1 / (1 - p)`; `p == 0` returns `x` itself."""
    if p == 0:
        return x
    if p == 1:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    noise = torch.empty_like(x).bernoulli_(1 - p, generator=generator)
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
