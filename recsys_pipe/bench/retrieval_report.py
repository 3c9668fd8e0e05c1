"""Summary of a retrieval reproduction (scripts/reproduce_games.sh): for each run under OUT_DIR
(`sasrec/`, `hstu/`), the evaluation with the best validation HR@10 (sampled protocol), its test
metrics next to the published ones, the training time, a check that the run's dump recomputes
the printed metrics, and an HR@10-vs-epoch plot (`OUT_DIR/hr10_vs_epoch.png`). The last line is
one JSON object with every figure.

    recsys-bench retrieval_report OUT_DIR
"""

from __future__ import annotations

import csv
import json
import re
import statistics
import sys
from pathlib import Path

import torch

from recsys_pipe.train.retrieval_eval import retrieval_metrics

#: Amazon Games, sampled protocol (100 negatives): the SASRec paper (Kang & McAuley 2018, Table III)
#: and pmixer/SASRec.pytorch's Result_Norm.md (the original block layout, and pre-LN blocks)
PUBLISHED = {
    "paper": {"HR@10": 0.7410, "NDCG@10": 0.5360},
    "pmixer": {"HR@10": 0.7318, "NDCG@10": 0.5308},
    "pmixer pre-LN": {"HR@10": 0.7442, "NDCG@10": 0.5376},
}
#: the reproduction's target on the test split (sampled protocol)
TARGET = {"HR@10": 0.73, "NDCG@10": 0.52}


def crossing(curve: list[tuple[float, float, float]], column: int, level: float) -> float | None:
    """The first epoch at which `curve`'s column (1: validation, 2: test HR@10) reaches `level`."""
    return next((point[0] for point in curve if point[column] >= level), None)


def evaluations(run: Path) -> list[dict]:
    """The evaluation records (those with a test split) of a run's metrics.jsonl."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "test" in r]


def steps_per_epoch(run: Path) -> int | None:
    """Steps of the first epoch, from the run's train.log; None without one."""
    for line in (run / "train.log").read_text().splitlines() if (run / "train.log").exists() else []:
        if "epoch 1/" in line and "done at step" in line:
            return int(line.rsplit("step", 1)[1])
    return None


def samples_per_s(run: Path) -> float | None:
    """Median training throughput of the run's log windows (`step N | ... | X samples/s`; the
    median leaves out the few windows an evaluation fell in)."""
    log = run / "train.log"
    rates = [float(m) for m in re.findall(r"\| ([0-9.]+) samples/s \|", log.read_text())] if log.exists() else []
    return statistics.median(rates) if rates else None


def summarise(run: Path) -> dict:
    """One run's figures: the selected evaluation, the HR@10 curve by epoch, timing, and the dump check."""
    evals = evaluations(run)
    selected = [r for r in evals if r.get("selected")][-1]
    per_epoch = steps_per_epoch(run)
    curve = [
        (
            r["step"] / per_epoch if per_epoch else r["step"],
            r["valid"]["sampled"]["HR@10"],
            r["test"]["sampled"]["HR@10"],
        )
        for r in evals
    ]
    out = {
        "sampled": selected["test"]["sampled"],
        "full": selected["test"].get("full", {}),
        "valid_sampled": selected["valid"]["sampled"],
        "selected_step": selected["step"],
        "selected_epoch": selected["step"] / per_epoch if per_epoch else None,
        "epochs_evaluated": len(evals) - 1,
        "users": selected["users"]["test"],
        "curve": curve,
    }
    dump = run / "eval_dump.csv"
    if dump.exists():
        with dump.open() as f:
            rows = list(csv.DictReader(f))
        for protocol, column in (("sampled", "rank_sampled"), ("full", "rank_full")):
            if out[protocol]:
                ranks = torch.tensor([int(r[column]) for r in rows])
                out[f"dump_recomputes_{protocol}"] = retrieval_metrics(ranks) == out[protocol]
    seconds = run / "train_seconds"
    out["train_s"] = int(seconds.read_text()) if seconds.exists() else None
    out["samples_per_s"] = samples_per_s(run)
    return out


def plot(runs: dict[str, dict], path: Path) -> None:
    """Plot validation and test HR@10 against the epoch for every run into `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in runs.items():
        epochs = [c[0] for c in s["curve"]]
        ax.plot(epochs, [c[1] for c in s["curve"]], label=f"{name} validation")
        ax.plot(epochs, [c[2] for c in s["curve"]], "--", label=f"{name} test")
    levels = {**{f"{name} {ref['HR@10']}": ref["HR@10"] for name, ref in PUBLISHED.items()}}
    levels[f"target {TARGET['HR@10']}"] = TARGET["HR@10"]
    for k, (label, level) in enumerate(sorted(levels.items(), key=lambda item: item[1])):
        ax.axhline(level, color="red" if label.startswith("target") else "grey", lw=0.8, ls=":")
        # labels at the right, moved apart so that close levels stay readable
        ax.annotate(
            label,
            (1.0, level),
            xytext=(4, 9 * k - 13),
            textcoords="offset points",
            xycoords=("axes fraction", "data"),
            fontsize=7,
            va="center",
        )
    for name, s in runs.items():
        epoch = crossing(s["curve"], 2, TARGET["HR@10"])
        if epoch is not None:
            ax.axvline(epoch, color="red", lw=0.6, ls=":")
            ax.text(epoch, TARGET["HR@10"], f" {name} test >= {TARGET['HR@10']} at {epoch:g}", fontsize=7)
    ax.set_ylim(0.5, 0.8)  # the first evaluations (~0.1, before training) lie below
    ax.set_xlabel("epoch")
    ax.set_ylabel("HR@10 (100 sampled negatives)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def label(run: str) -> str:
    """How the table names a run: ours, or the reference implementation's (`hstu_reference`,
    `python -m recsys_pipe.bench.hstu_train_reference`)."""
    return "ref. HSTU (gen-rec)" if run == "hstu_reference" else f"ours {run}"


def main(out_dir: str) -> None:
    """Print the published rows next to ours, the targets, the plot's path and one JSON line."""
    root = Path(out_dir)
    names = ("sasrec", "hstu", "hstu_reference", "hstu_large")
    runs = {name: summarise(root / name) for name in names if (root / name / "metrics.jsonl").exists()}
    print(f"{'':22} {'HR@10':>7} {'NDCG@10':>8}   protocol: leave-one-out, test split, 100 sampled negatives")
    for name, ref in PUBLISHED.items():
        print(f"{name:22} {ref['HR@10']:7.4f} {ref['NDCG@10']:8.4f}")
    for name, s in runs.items():
        m = s["sampled"]
        print(
            f"{label(name):22} {m['HR@10']:7.4f} {m['NDCG@10']:8.4f}   epoch {s['selected_epoch']} "
            f"(best validation HR@10 of {s['epochs_evaluated']} evaluations), {s['train_s']} s, "
            f"{s['samples_per_s']} samples/s training"
        )
    for name, s in runs.items():
        if s["full"]:
            f = s["full"]
            print(
                f"{label(name) + ' full':22} {f['HR@10']:7.4f} {f['NDCG@10']:8.4f}   full corpus; HR@50 "
                f"{f['HR@50']:.4f} HR@200 {f['HR@200']:.4f} NDCG@200 {f['NDCG@200']:.4f}"
            )
    for name, s in runs.items():
        m, epoch = s["sampled"], crossing(s["curve"], 2, TARGET["HR@10"])
        met = all(m[k] >= v for k, v in TARGET.items())
        where = (
            f"test HR@10 first >= {TARGET['HR@10']} at epoch {epoch:g}"
            if epoch is not None
            else (f"test HR@10 never reached {TARGET['HR@10']} (best {max(c[2] for c in s['curve']):.4f})")
        )
        print(
            f"{name}: target HR@10 >= {TARGET['HR@10']}, NDCG@10 >= {TARGET['NDCG@10']}: "
            f"{'met' if met else 'NOT met'} at the selected epoch; {where}"
        )
        s["target_met"], s["test_crosses_at_epoch"] = met, epoch
    if runs:
        plot(runs, root / "hr10_vs_epoch.png")
        print(f"plot: {root / 'hr10_vs_epoch.png'}")
    summary = {
        **{
            name: {
                k: s[k] for k in ("sampled", "full", "selected_epoch", "users", "target_met", "test_crosses_at_epoch")
            }
            for name, s in runs.items()
        },
        "train_s": {name: s["train_s"] for name, s in runs.items()},
        "samples_per_s": {name: s["samples_per_s"] for name, s in runs.items()},
        "dump": {name: str(root / name / "eval_dump.csv") for name in runs},
        "dump_recomputes": {
            name: [s.get("dump_recomputes_sampled"), s.get("dump_recomputes_full")] for name, s in runs.items()
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1])
