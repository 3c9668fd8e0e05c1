"""Pictures of a compiled plan (matplotlib; graphviz optional): `recsys-plan plot=true`.

Why pictures: the timing diagram shows at a glance how many batches overlap and when each
lookahead fills and drains; the DAG shows what waits on what.
Lives in the CLI layer because the plan compiler must not depend on matplotlib.
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Any

from recsys_pipe.config import CompiledPlan, firing_table

__all__ = ["plot_timing", "plot_dag", "write_dot"]

_PHASE_COLOURS = {"prefill": "#dbe9f6", "steady": "#e5f5e0", "drain": "#fde0c5"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    """Lay `fig` out, write it to `path` as PNG and close it (pyplot keeps every open figure)."""
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timing(plan: CompiledPlan, path: str | Path, num_batches: int = 4) -> Path:
    """PNG grid: rows = (lookahead, stream), columns = internal iterations (prefill, steady,
    drain), cells = the batch those tasks process; bottom row = what progress() returns."""
    plt = _pyplot()
    table = firing_table(plan, num_batches)
    n_cols = table.num_iterations
    cmap = plt.get_cmap("tab10")
    labels = [
        f"la {r.lookahead} · {r.stream}\n" + "\n".join(textwrap.wrap(", ".join(r.tasks), 34)) for r in table.rows
    ] + ["progress()\nreturns"]
    heights = [max(1.0, 0.32 * label.count("\n") + 0.6) for label in labels]
    fig_h = 1.3 + 0.55 * sum(heights)
    fig, ax = plt.subplots(figsize=(3.2 + 1.05 * n_cols, fig_h))
    y_top = sum(heights)
    y = y_top
    centres = []
    for row_i, h in enumerate(heights):
        y -= h
        centres.append(y + h / 2)
        cells = table.rows[row_i].cells if row_i < len(table.rows) else table.returns
        for i, batch in enumerate(cells):
            if batch is None:
                ax.add_patch(
                    plt.Rectangle((i + 0.04, y + 0.08), 0.92, h - 0.16, fill=False, edgecolor="#cccccc", linestyle=":")
                )
                continue
            ax.add_patch(plt.Rectangle((i + 0.04, y + 0.08), 0.92, h - 0.16, color=cmap(batch % 10), alpha=0.85))
            ax.text(
                i + 0.5,
                y + h / 2,
                f"batch {batch}",
                ha="center",
                va="center",
                fontsize=9,
                color="white",
                fontweight="bold",
            )
    for i, phase in enumerate(table.phases):
        ax.add_patch(plt.Rectangle((i, y_top), 1, 0.55, color=_PHASE_COLOURS.get(phase, "#eeeeee")))
        ax.text(i + 0.5, y_top + 0.275, f"i={i}\n{phase}", ha="center", va="center", fontsize=8)
    ax.axhline(heights[-1], color="black", linewidth=0.8)
    ax.set_xlim(0, n_cols)
    ax.set_ylim(0, y_top + 0.6)
    ax.set_yticks(centres)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    name = plan.config.name or "plan"
    ax.set_title(
        f"{name}: batch processed per internal iteration; {plan.graph.in_flight_batches} batches "
        f"in flight (max lookahead {plan.graph.max_lookahead}), {num_batches} batches shown",
        fontsize=10,
    )
    return _save(plt, fig, path)


def _lanes(plan: CompiledPlan) -> list[tuple[int, str]]:
    """Swimlanes of both pictures: (lookahead, stream), deepest lookahead on top."""
    rank = {s: r for r, s in enumerate(plan.task_graph.stream_slots)}
    lanes = {(t.lookahead, t.stream) for t in plan.order}
    return sorted(lanes, key=lambda ls: (-ls[0], rank.get(ls[1], 99)))


def _arc_room(plan: CompiledPlan, pos: dict[str, tuple[float, float]]) -> float:
    order = {t.name: i for i, t in enumerate(plan.order)}
    room = 0.0
    for e in plan.cpu_edges():
        if order[e.consumer] - order[e.producer] > 1 and pos[e.producer][1] == pos[e.consumer][1]:
            room = max(room, 0.15 * abs(pos[e.consumer][0] - pos[e.producer][0]) + pos[e.producer][1])
    return room


#: colour of each kind of in-iteration edge in the DAG
_KIND_COLOUR = {
    "slot": "#1f77b4",
    "depends_on": "#d62728",
    "same_progress_sync": "#9467bd",
    "cross_iter(Δ=0)": "#8c564b",
    "stream_fifo": "#999999",
}
#: grid of the DAG: horizontal and vertical distance of the boxes
_SX, _SY = 1.9, 1.25


def plot_dag(plan: CompiledPlan, path: str | Path) -> Path:
    """PNG of the task graph as swimlanes: one lane per (lookahead, stream), tasks left to right
    in execution (topological) order, boxes labelled with their CPU thread. Solid arrows:
    in-iteration edges (colour = declaration kind); dotted: same-stream FIFO; dashed:
    cross-iteration dependencies (Δ iterations earlier, carried by ring rotation)."""
    plt = _pyplot()
    lanes = _lanes(plan)
    lane_of = {lane: i for i, lane in enumerate(lanes)}
    pos = {t.name: (n * _SX, -lane_of[(t.lookahead, t.stream)] * _SY) for n, t in enumerate(plan.order)}
    streams = list(plan.task_graph.stream_slots)
    cmap = plt.get_cmap("Set2")
    colour = {s: cmap(i % 8) for i, s in enumerate(streams)}
    n = len(plan.order)
    fig, ax = plt.subplots(figsize=(3.5 + 1.55 * n, 1.4 + 1.05 * len(lanes) + 0.6 * _arc_room(plan, pos)))
    for i, (la, stream) in enumerate(lanes):
        y = -i * _SY
        ax.axhspan(y - _SY / 2, y + _SY / 2, color="#f4f4f4" if i % 2 == 0 else "white", zorder=0)
        ax.text(-_SX * 0.62, y, f"la {la}\n{stream}", ha="right", va="center", fontsize=8)
    boxes = _task_boxes(ax, plan, pos, colour)
    top = _draw_edges(ax, plan, pos, boxes)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[s]) for s in streams]
    handles += [
        plt.Line2D([0], [0], color=c, linestyle=":" if k == "stream_fifo" else "-") for k, c in _KIND_COLOUR.items()
    ]
    handles += [plt.Line2D([0], [0], color="#7f7f7f", linestyle="--")]
    names = [f"stream {s}" for s in streams] + list(_KIND_COLOUR) + ["cross-iteration (ring)"]
    ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_xlim(-_SX * 1.3, (n - 1) * _SX + _SX * 0.6)
    ax.set_ylim(-(len(lanes) - 0.5) * _SY - 0.5, _SY / 2 + top)
    ax.axis("off")
    ax.set_title(
        f"{plan.config.name or 'plan'}: tasks in execution order (left to right), one lane per "
        "lookahead and stream; boxes show the CPU thread",
        fontsize=9,
    )
    return _save(plt, fig, path)


def _task_boxes(ax: Any, plan: CompiledPlan, pos: dict[str, tuple[float, float]], colour: dict) -> dict[str, Any]:
    """One box per task at `pos`, in its stream's colour, labelled with its thread (and nccl)."""
    boxes = {}
    for t in plan.order:
        x, y = pos[t.name]
        label = f"{t.name}\n{plan.thread_of[t.name]}" + (" · nccl" if t.nccl else "")
        boxes[t.name] = ax.text(
            x,
            y,
            label,
            ha="center",
            va="center",
            fontsize=7,
            zorder=3,
            bbox={"boxstyle": "round,pad=0.35", "facecolor": colour.get(t.stream, "#dddddd"), "edgecolor": "black"},
        )
    return boxes


def _draw_edges(ax: Any, plan: CompiledPlan, pos: dict[str, tuple[float, float]], boxes: dict[str, Any]) -> float:
    """The CPU edges (arcs over the boxes they skip in a lane) and the cross-iteration
    dependencies (dashed, labelled with Δ); returns the head room the arcs need above the top lane."""

    def arrow(a: str, b: str, style: str, col: str, rad: float, label: str | None = None) -> None:
        ax.annotate(
            "",
            xy=pos[b],
            xytext=pos[a],
            zorder=2,
            arrowprops={
                "arrowstyle": "-|>",
                "color": col,
                "linestyle": style,
                "lw": 1.1,
                "patchA": boxes[a].get_bbox_patch(),
                "patchB": boxes[b].get_bbox_patch(),
                "shrinkA": 2,
                "shrinkB": 2,
                "connectionstyle": f"arc3,rad={rad}",
            },
        )
        if label:
            (x1, y1), (x2, y2) = pos[a], pos[b]
            ax.text((x1 + x2) / 2, (y1 + y2) / 2 + 0.18, label, fontsize=7, color=col, ha="center", zorder=4)

    order = {t.name: i for i, t in enumerate(plan.order)}
    top = 0.3  # head room for arcs that skip over boxes in a lane (an arc rises ~rad * length / 2)
    for e in plan.cpu_edges():
        if order[e.consumer] - order[e.producer] > 1 and pos[e.producer][1] == pos[e.consumer][1]:
            top = max(top, 0.3 * abs(pos[e.consumer][0] - pos[e.producer][0]) / 2 + 0.2 + pos[e.producer][1])
        skip = order[e.consumer] - order[e.producer] > 1 and pos[e.producer][1] == pos[e.consumer][1]
        arrow(
            e.producer,
            e.consumer,
            ":" if e.kind == "stream_fifo" else "-",
            _KIND_COLOUR.get(e.kind, "black"),
            rad=(0.3 if e.kind == "stream_fifo" else -0.3) if skip else 0.0,
        )
    seen = set()
    for d in plan.graph.dependencies:
        if d.in_iteration or (d.producer, d.consumer) in seen:
            continue
        seen.add((d.producer, d.consumer))
        arrow(d.producer, d.consumer, "--", "#7f7f7f", rad=-0.15, label=f"Δ={d.delta}")
    return top


def write_dot(plan: CompiledPlan, path: str | Path, render: bool = True) -> list[Path]:
    """Graphviz source of the DAG; also rendered to PNG when the `dot` binary is installed."""
    lines = ["digraph plan {", "  rankdir=LR; node [shape=box, style=rounded];"]
    for t in plan.order:
        lines.append(f'  "{t.name}" [label="{t.name}\\nla {t.lookahead} · {t.stream} · {plan.thread_of[t.name]}"];')
    for e in plan.cpu_edges():
        style = "dotted" if e.kind == "stream_fifo" else "solid"
        lines.append(f'  "{e.producer}" -> "{e.consumer}" [label="{e.kind}", style={style}];')
    for d in plan.graph.dependencies:
        if not d.in_iteration:
            lines.append(f'  "{d.producer}" -> "{d.consumer}" [label="Δ={d.delta}", style=dashed, constraint=false];')
    lines.append("}")
    path = Path(path)
    path.write_text("\n".join(lines) + "\n")
    written = [path]
    dot = shutil.which("dot")
    if render and dot:
        png = path.with_suffix(".graphviz.png")
        if subprocess.run([dot, "-Tpng", str(path), "-o", str(png)], capture_output=True).returncode == 0:
            written.append(png)
    return written
