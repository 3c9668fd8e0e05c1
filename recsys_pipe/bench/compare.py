"""Before and after, side by side in one run: a benchmark run alternately on this tree's code and
on a baseline's, its figures paired.

    recsys-bench compare --baseline main engine_costs --quick
    recsys-bench compare --baseline bb8f7c6 --rounds 7 --keys 'sequential.*,threaded.*' engine
    recsys-bench compare --baseline ../old-checkout train --host --batch-sizes 32 --repeats 1

The baseline is a git ref of this repository (exported with `git archive` into a temporary
directory) or a directory holding a checkout. This tree's benchmarks measure both sides: its
`recsys_pipe/bench` package replaces the baseline's there, so only the library code differs
(a benchmark that needs an API the baseline lacks fails on that side, and the comparison stops
with its error). Each round runs the benchmark once per side, the order alternating, as
`python -m <module> ARGS` with the side's tree first on `PYTHONPATH`, so a slow spell of a
shared machine hits both. The two JSON reports (the last line every benchmark prints) are
paired number by number along their paths (a `{median, min, max}` summary counts as its median).

Printed per figure (`--keys`: glob patterns on the dotted paths; default every figure): this
tree's and the baseline's median (min–max) over the rounds, and the median (min–max) of the
per-round ratios this / baseline. The last line is one JSON object with all of it.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from recsys_pipe.bench.common import summary
from recsys_pipe.bench.registry import BENCHMARKS

__all__ = ["baseline_tree", "flatten", "main", "pair_rounds"]

#: this tree: the directory holding the `recsys_pipe` package
ROOT = Path(__file__).resolve().parents[2]


def baseline_tree(baseline: str, into: Path) -> Path:
    """A copy of the baseline's `recsys_pipe` under `into` with this tree's bench package in it.

    Args:
        baseline: a directory holding a checkout, or a git ref of this repository.
        into: an empty directory.

    Returns:
        `into`, to put first on `PYTHONPATH`."""
    source = Path(baseline)
    if source.is_dir():
        if not (source / "recsys_pipe").is_dir():
            raise SystemExit(f"error: --baseline: {source} holds no recsys_pipe package")
        shutil.copytree(source / "recsys_pipe", into / "recsys_pipe", ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", baseline, "recsys_pipe"],
            capture_output=True,
        )
        if archive.returncode != 0:
            raise SystemExit(f"error: --baseline: {baseline!r} is neither a directory nor a git ref of {ROOT}")
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    shutil.rmtree(into / "recsys_pipe" / "bench")
    shutil.copytree(
        ROOT / "recsys_pipe" / "bench", into / "recsys_pipe" / "bench", ignore=shutil.ignore_patterns("__pycache__")
    )
    return into


def run_side(tree: Path, module: str, args: list[str]) -> dict[str, Any]:
    """One run of `module` with `tree` first on the path: its JSON report (SystemExit if none)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    # run from the tree itself: `python -m` puts the working directory first on the path
    done = subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=tree, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise SystemExit(f"error: {module} on {tree} printed no report (exit {done.returncode}):\n{tail}")
    return json.loads(lines[-1])


def flatten(report: Any, path: str = "") -> dict[str, float]:
    """Every number of a report by its dotted path; a `{median, min, max}` summary is its median."""
    if isinstance(report, dict):
        if {"median", "min", "max"} <= report.keys() and isinstance(report["median"], (int, float)):
            return {path: float(report["median"])}
        out: dict[str, float] = {}
        for key, value in report.items():
            out.update(flatten(value, f"{path}.{key}" if path else str(key)))
        return out
    if isinstance(report, (int, float)) and not isinstance(report, bool):
        return {path: float(report)}
    return {}


def pair_rounds(after: list[dict[str, float]], before: list[dict[str, float]], keys: list[str]) -> dict[str, Any]:
    """Per path present on both sides in every round (and matching `keys`): both sides' median
    (min–max) and the per-round ratios after / before."""
    common = set.intersection(*(set(r) for r in after + before))
    paths = [p for p in after[0] if p in common and (not keys or any(fnmatch.fnmatch(p, k) for k in keys))]
    out = {}
    for path in paths:
        a, b = [r[path] for r in after], [r[path] for r in before]
        ratios = [x / y for x, y in zip(a, b) if y != 0]
        out[path] = {"after": summary(a, 4), "before": summary(b, 4), "ratio": summary(ratios) if ratios else None}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="recsys-bench compare",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--baseline", required=True, help="a git ref of this repository, or a directory with a checkout"
    )
    parser.add_argument("--rounds", type=int, default=5, help="runs per side, alternating (default 5)")
    parser.add_argument("--keys", default="", help="comma-separated glob patterns of the figures to show (default all)")
    parser.add_argument("name", choices=[n for n in BENCHMARKS if n != "compare"], help="the benchmark")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's arguments")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    module = BENCHMARKS[args.name].module
    keys = [k for k in args.keys.split(",") if k]
    with tempfile.TemporaryDirectory(prefix="recsys_baseline_") as tmp:
        base = baseline_tree(args.baseline, Path(tmp))
        reports: dict[str, list[dict[str, float]]] = {"after": [], "before": []}
        for r in range(args.rounds):
            sides = [("after", ROOT), ("before", base)]
            for side, tree in sides if r % 2 == 0 else sides[::-1]:
                print(f"[compare] round {r + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
                reports[side].append(flatten(run_side(tree, module, args.args)))
    pairs = pair_rounds(reports["after"], reports["before"], keys)
    print(
        f"{args.name} {' '.join(args.args)}: this tree (after) against {args.baseline} (before), "
        f"{args.rounds} alternating rounds; median (min–max) over rounds"
    )
    width = max((len(p) for p in pairs), default=10)
    print(f"{'figure':<{width}}  {'after':>28}  {'before':>28}  {'after / before':>26}")
    for path, row in pairs.items():
        ratio = row["ratio"]
        text = f"{ratio['median']} ({ratio['min']}–{ratio['max']})" if ratio else "-"
        cells = [f"{row[s]['median']} ({row[s]['min']}–{row[s]['max']})" for s in ("after", "before")]
        print(f"{path:<{width}}  {cells[0]:>28}  {cells[1]:>28}  {text:>26}")
    print(
        json.dumps(
            {
                "benchmark": args.name,
                "args": args.args,
                "baseline": args.baseline,
                "rounds": args.rounds,
                "figures": pairs,
            }
        )
    )


if __name__ == "__main__":
    main()
