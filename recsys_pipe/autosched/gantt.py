"""Gantt charts of simulated timelines (plan simulator and pipeline-parallel simulator).

Drawn with matplotlib's object API on an Agg canvas, so nothing changes global pyplot state and
no display is needed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Bar", "draw_gantt"]


@dataclass(frozen=True)
class Bar:
    """One span on one row: `group` picks the colour (the batch or microbatch it works on)."""

    row: str
    start: float
    end: float
    label: str
    group: int
    highlight: bool = False


def draw_gantt(
    bars: Sequence[Bar],
    rows: Sequence[str],
    path: str | os.PathLike,
    *,
    title: str = "",
    time_range: tuple[float, float] | None = None,
    legend_title: str = "batch",
    time_unit: tuple[str, float] = ("ms", 1e3),
) -> Path:
    """Draw `bars` on `rows` (top to bottom) into a PNG at `path`.

    `time_unit` is the axis label and the factor from bar times to it (default: seconds shown
    in ms; `("", 1.0)` for unitless times).

    Bars are coloured by `group`, labelled with their text when wide enough, and outlined in
    black when `highlight` (the critical path). Returns the path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if time_range is None:
        lo = min((b.start for b in bars), default=0.0)
        hi = max((b.end for b in bars), default=1.0)
    else:
        lo, hi = time_range
    unit, scale = time_unit
    span = max(hi - lo, 1e-12)
    row_index = {r: k for k, r in enumerate(rows)}
    fig = Figure(figsize=(14, 1.0 + 0.55 * len(rows)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    cmap = _colours()
    groups: dict[int, str] = {}
    for bar in bars:
        if bar.end <= bar.start or bar.row not in row_index or bar.end < lo or bar.start > hi:
            continue
        y = row_index[bar.row]
        colour = cmap[bar.group % len(cmap)]
        groups.setdefault(bar.group, colour)
        ax.barh(
            y,
            (bar.end - bar.start) * scale,
            left=bar.start * scale,
            height=0.7,
            color=colour,
            edgecolor="black" if bar.highlight else "white",
            linewidth=1.6 if bar.highlight else 0.5,
        )
        if (bar.end - bar.start) / span > 0.035:
            mid = (max(bar.start, lo) + min(bar.end, hi)) / 2 * scale
            ax.text(mid, y, bar.label, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(lo * scale, hi * scale)
    ax.set_xlabel(f"time ({unit})" if unit else "time")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    if groups:
        handles = [Patch(color=c, label=str(g)) for g, c in sorted(groups.items())]
        ax.legend(handles=handles, title=legend_title, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out


def _colours() -> list:
    from matplotlib import colormaps

    return list(colormaps["tab20"].colors)
