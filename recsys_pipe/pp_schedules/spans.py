"""A schedule's actions on a timeline: `PipelineSpan` (one action of one rank, simulated or
measured) and `peak_activations` (the activations a rank's order holds at most)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from recsys_pipe.pp_schedules.actions import Action

__all__ = ["PipelineSpan", "peak_activations"]


@dataclass(frozen=True)
class PipelineSpan:
    """One action of one rank on the timeline."""

    rank: int
    action: str  #: torch's form, e.g. `0F3`
    microbatch: int | None
    start: float
    end: float
    label: str = ""  #: our short form, e.g. `F3`, `F3&BW7`


def peak_activations(row: Sequence[Action]) -> int:
    """The most microbatches whose forward ran and whose backward (B or BW) has not, along one
    rank's action order."""
    held = peak = 0
    for action in row:
        for c in action.computes:  # an overlapped pair holds the new activation before freeing
            if c.kind == "F":
                held += 1
                peak = max(peak, held)
        held -= sum(c.kind in ("B", "BW") for c in action.computes)
    return peak
