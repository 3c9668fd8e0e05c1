"""Pipeline-parallel actions and per-rank schedules, with torch's string and CSV forms.

An `Action` is one step of one rank: a forward `F`, an input-gradient backward `B`, a
weight-gradient backward `W`, a full backward `BW` (B and W as one step), an overlapped pair
`FB` (a forward and a backward of different microbatches run together, as DualPipe does), or a
communication / bookkeeping step (`SEND_F`, `RECV_F`, `SEND_B`, `RECV_B`, `UNSHARD`, `RESHARD`,
`REDUCE_GRAD`) that takes no compute time.

Strings and CSV follow `torch.distributed.pipelining`: an action prints as
`<stage><code><microbatch>` (`0F1`, `3I0`, `2SEND_F5`, `1REDUCE_GRAD`), an overlapped pair as
`(0F2;3B0)OVERLAP_F_B`, and a schedule CSV has one row per rank, one action per cell, empty
cells for idle steps. torch's codes differ from ours for the backwards: torch `I` (backward
input) is our `B`, torch `B` (full backward) is our `BW`.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Action", "PipelineSchedule", "from_csv", "to_csv"]

COMPUTE = ("F", "B", "W", "BW", "FB")
COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
MARKERS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
KINDS = COMPUTE + COMMS + MARKERS

#: our kind -> torch's computation-type code
_TO_TORCH = {"F": "F", "B": "I", "W": "W", "BW": "B", "FB": "OVERLAP_F_B", **{k: k for k in COMMS + MARKERS}}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_PATTERN = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")


@dataclass(frozen=True)
class Action:
    """One step of a rank: `kind` on `stage` for `microbatch` (None for markers like
    REDUCE_GRAD). An `FB` holds its forward and backward parts in `parts`."""

    kind: str
    stage: int = -1
    microbatch: int | None = None
    parts: tuple[Action, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; kinds: {', '.join(KINDS)}")
        if self.kind == "FB":
            kinds = tuple(p.kind for p in self.parts)
            if len(kinds) != 2 or kinds[0] != "F" or kinds[1] not in ("B", "BW"):
                raise ValueError(f"an FB action holds a forward and a backward (B or BW), got {kinds}")
        elif self.parts:
            raise ValueError(f"only FB actions have parts, not {self.kind}")
        if self.kind in COMPUTE[:4] + COMMS and (self.microbatch is None or self.stage < 0):
            raise ValueError(f"a {self.kind} action needs a stage and a microbatch")

    @property
    def computes(self) -> tuple[Action, ...]:
        """The compute steps this action performs (its parts for FB, else itself if compute)."""
        if self.kind == "FB":
            return self.parts
        return (self,) if self.kind in COMPUTE else ()

    @property
    def short(self) -> str:
        """Our kind and the microbatch, e.g. `F3`, `BW3`, `F3&BW7` (for charts)."""
        if self.kind == "FB":
            return "&".join(p.short for p in self.parts)
        return f"{self.kind}{'' if self.microbatch is None else self.microbatch}"

    def __str__(self) -> str:
        if self.kind == "FB":
            return f"({';'.join(map(str, self.parts))}){_TO_TORCH['FB']}"
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{_TO_TORCH[self.kind]}{mb}"

    @classmethod
    def parse(cls, text: str) -> Action | None:
        """The action written as `text` in torch's form; None for an empty cell."""
        text = text.strip()
        if not text:
            return None
        if text.startswith("("):
            close = text.find(")")
            code = text[close + 1 :]
            if close < 0 or code != _TO_TORCH["FB"]:
                raise ValueError(f"cannot parse action {text!r}: only OVERLAP_F_B groups are supported")
            parts = [cls.parse(p) for p in text[1:close].split(";")]
            return cls("FB", parts=tuple(p for p in parts if p is not None))
        match = _PATTERN.fullmatch(text)
        if match is None:
            raise ValueError(f"cannot parse action {text!r}: expected <stage><type><microbatch>, e.g. 0F1")
        stage, code, mb = match.groups()
        return cls(_FROM_TORCH[code], int(stage), int(mb) if mb else None)


@dataclass(frozen=True)
class PipelineSchedule:
    """What each rank runs, in order: `ranks[r]` is rank r's action list."""

    ranks: tuple[tuple[Action, ...], ...]
    name: str = ""

    @classmethod
    def of(
        cls, actions: PipelineSchedule | Mapping[int, Iterable] | Sequence[Iterable], name: str = ""
    ) -> PipelineSchedule:
        """Accept a schedule, a `{rank: [actions]}` dict (torch's `pipeline_order`) or a list of
        per-rank lists; items may be Actions, strings (`"0F1"`), or None / "" (idle steps)."""
        if isinstance(actions, PipelineSchedule):
            return actions
        if isinstance(actions, Mapping):
            if sorted(actions) != list(range(len(actions))):
                raise ValueError(f"ranks must be 0..{len(actions) - 1}, got {sorted(actions)}")
            rows = [actions[r] for r in range(len(actions))]
        else:
            rows = list(actions)
        ranks = []
        for row in rows:
            out = []
            for item in row:
                action = _as_action(item)
                if action is not None:
                    out.append(action)
            ranks.append(tuple(out))
        return cls(tuple(ranks), name)

    @property
    def num_ranks(self) -> int:
        """Ranks the schedule runs on (its rows)."""
        return len(self.ranks)

    @property
    def num_microbatches(self) -> int:
        """Microbatches of a step: one more than the highest a compute step names."""
        mbs = [c.microbatch for row in self.ranks for a in row for c in a.computes]
        return max(mbs) + 1 if mbs else 0

    @property
    def num_stages(self) -> int:
        """Stages over all ranks: one more than the highest a compute step names."""
        stages = [c.stage for row in self.ranks for a in row for c in a.computes]
        return max(stages) + 1 if stages else 0

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: {' '.join(map(str, row))}" for r, row in enumerate(self.ranks))


def _as_action(item) -> Action | None:
    if item is None or isinstance(item, Action):
        return item
    text = str(item)  # torch's _Action prints in the same form
    return Action.parse(text)


def to_csv(schedule: PipelineSchedule | Mapping | Sequence, path: str | os.PathLike | None = None) -> str:
    """torch's schedule CSV (one row per rank); also written to `path` when given."""
    schedule = PipelineSchedule.of(schedule)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for row in schedule.ranks:
        writer.writerow([str(a) for a in row])
    text = buffer.getvalue()
    if path is not None:
        Path(path).write_text(text)
    return text


def from_csv(source: str | os.PathLike, name: str = "") -> PipelineSchedule:
    """Read torch's schedule CSV (compute-only or with comms) from a file, or from CSV text
    (a string holding a comma or a newline)."""
    if isinstance(source, str) and ("," in source or "\n" in source):
        text = source
    else:
        text = Path(source).read_text()
    rows = []
    for number, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        try:
            rows.append([Action.parse(cell) for cell in row])
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}") from None
    return PipelineSchedule.of(rows, name)
