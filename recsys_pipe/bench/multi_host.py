"""Beyond one machine, on one machine: 8 ranks as 2 hosts x 4 (two torchrun agents, `--nnodes 2`,
c10d rendezvous on 127.0.0.1, gloo on the CPU), the checks of docs/operations/multi-node.md.

* **parity** (the 8-rank set): DLRM trains 20 steps with its tables `table_wise`, `row_wise`,
  `column_wise`, `table_column_wise`, `table_row_wise`, by torchrec's planner and by the planner
  held to `table_row_wise` for one table; HSTU ranking with `table_wise`, `row_wise`,
  `column_wise` and the planner at 4 ranks (2 x 2). Each against one rank trained on the same
  global batches: the per-step losses within `RTOL`.
* **reshard**: one 30-step run broken as 10 steps on 8 ranks `row_wise`, resumed on 4 ranks
  `table_row_wise` (2 x 2), on 2 ranks `table_wise`, on 1 rank, with `data=parquet`; against
  the same run unbroken on one rank: the losses within `RTOL`, the tables and their optimizer
  state at the end (Adagrad on the fused kernel; Adam on the dense kernel: both kernels run),
  and every row of the epoch trained once.
* **memory**: each rank's peak RSS at 1, 2, 4 and 8 ranks on the CPU against the estimate
  (`recsys_pipe.train.memory`), with glibc's default allocator and with its mmap threshold
  fixed (`MALLOC_MMAP_THRESHOLD_`: without it, freed build temporaries stay resident on some
  ranks and not others); and for 64 ranks (8 x 8) rank 0's tables built for real under torch's
  fake process group against the estimate's table part (`recsys-plan ... dry_run=true`).

    recsys-bench multi_host                                  # every part, results into the docs
    recsys-bench multi_host --parts parity --docs none       # the 8-rank set alone

Prints a summary, writes `multi_host.json` into `--out` and the results section of
docs/operations/multi-node.md (between its `multi_host` markers), with the wall and CPU time
of each part and the machine's load. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

WORKER = "recsys_pipe.bench.multi_host_worker"
#: losses (and final tables) of N ranks against one rank agree this closely
RTOL = 1e-5
#: the memory estimate against the measured peak RSS, and the 64-rank table part
RSS_TOLERANCE, TABLE_TOLERANCE = 0.20, 0.05
STEPS = 20
DLRM_VARIANTS = [
    "table_wise",
    "row_wise",
    "column_wise",
    "table_column_wise",
    "table_row_wise",
    "planner",
    "planner/cat_0_table=table_row_wise",
]
HSTU_VARIANTS = ["table_wise", "row_wise", "column_wise", "planner", "planner/item_table=column_wise"]
#: the broken run: (leg, hosts, ranks per host, sharding, until step)
LEGS = [("r8", 2, 4, "row_wise", 10), ("r4", 2, 2, "table_row_wise", 20), ("r2", 1, 2, "table_wise", 25)]
LAST = ("r1", 1, 1, "table_wise", 30)
GLOBAL_BATCH = 32
#: the run whose peak RSS is measured: 26 tables of 50,000 x 64 (317 MiB), row-wise Adagrad
RSS_RUN = [
    "model=dlrm",
    "data.num_embeddings=50000",
    "model.embedding_dim=64",
    "model.dense_arch_layer_sizes=[256,64]",
    "model.sharding=row_wise",
    "data.batch_size=64",
    "data.num_batches=10",
]
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
#: a run with almost no model: its peak RSS is the estimate's runtime part on the CPU
RUNTIME_RUN = ["model=dlrm", "data.num_embeddings=10", "model.sharding=row_wise", "data.num_batches=10"]
#: the 64-rank dry run: DLRM with 26 tables of 10^6 rows
DRY_RUN = ["model=dlrm", "data.num_embeddings=1000000"]
MARKERS = ("<!-- multi_host results: begin -->", "<!-- multi_host results: end -->")


def launch(out: Path, hosts: int, per_host: int, *args: str, env: dict[str, str] | None = None) -> None:
    """The worker on `hosts` x `per_host` ranks: one torchrun agent per host, meeting through a
    c10d rendezvous on 127.0.0.1 (one agent: `--standalone`). Raises on a failed rank."""
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(per_host)]
    if hosts == 1:
        commands = [[*base, "--standalone"]]
    else:
        port = _free_port()
        rendezvous = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"mh{port}"]
        commands = [[*base, "--nnodes", str(hosts), "--node_rank", str(h), *rendezvous] for h in range(hosts)]
    variables = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    logs = [open(out / f"agent{h}.log", "a") for h in range(len(commands))]  # noqa: SIM115 (closed below)
    try:
        agents = [
            subprocess.Popen([*c, "-m", WORKER, *args], stdout=log, stderr=subprocess.STDOUT, env=variables)
            for c, log in zip(commands, logs)
        ]
        codes = [a.wait(timeout=900) for a in agents]
    finally:
        for log in logs:
            log.close()
    if any(codes):
        tail = (out / "agent0.log").read_text()[-3000:]
        raise RuntimeError(f"{' '.join(args[:2])} on {hosts} x {per_host} ranks failed ({codes}):\n{tail}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: Path) -> Any:
    return json.loads(path.read_text())


def _rel(values: list[float], reference: list[float]) -> float:
    """The largest relative difference of `values` from `reference`, step by step."""
    assert len(values) == len(reference), (len(values), len(reference))
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(values, reference))


def parity(out: Path) -> dict[str, Any]:
    """Every sharding type on 8 ranks (DLRM) and 4 (HSTU) against one rank."""
    launch(out, 2, 4, "sharded", str(out), str(STEPS), f"dlrm:{','.join(DLRM_VARIANTS)}")
    launch(out, 2, 2, "sharded", str(out), str(STEPS), f"hstu:{','.join(HSTU_VARIANTS)}")
    launch(out, 1, 1, "one_rank", str(out), "8", "dlrm")
    launch(out, 1, 1, "one_rank", str(out), "4", "hstu")
    result: dict[str, Any] = {}
    for case, ranks in (("dlrm", 8), ("hstu", 4)):
        reference = _read(out / f"{case}_one_rank.json")["losses"]
        variants = _read(out / f"{case}_rank0.json")
        result[case] = {
            "ranks": ranks,
            "steps": len(reference),
            "variants": {
                name: {"max_rel": _rel(v["losses"], reference), "seconds": round(v["seconds"], 2)}
                for name, v in variants.items()
            },
        }
    return result


def reshard(out: Path, kernel: str) -> dict[str, Any]:
    """The 30-step run broken 8 -> 4 -> 2 -> 1 ranks against the same run unbroken on one rank."""
    import torch

    folder = out / f"reshard_{kernel}"
    folder.mkdir(exist_ok=True)
    previous: list[str] = []
    for name, hosts, per_host, sharding, until in [*LEGS, LAST]:
        args = [str(folder), name, str(GLOBAL_BATCH), str(until), sharding, *previous[-1:], kernel]
        launch(folder, hosts, per_host, "leg", *args)
        previous.append(name)
    launch(folder, 1, 1, "unbroken", str(folder), "unbroken", *previous, kernel)
    legs = [(name, hosts * per_host) for name, hosts, per_host, _, _ in [*LEGS, LAST]]
    records = {name: [_read(folder / f"{name}_rank{r}.json") for r in range(n)] for name, n in legs}
    losses = [x for name, _ in legs for x in records[name][0]["losses"]]
    unbroken_losses = _read(folder / "unbroken_rank0.json")["losses"]
    trained = [i for ranks in records.values() for rank in ranks for step in rank["sample_ids"] for i in step]
    end, whole = torch.load(folder / f"{LAST[0]}_state.pt"), torch.load(folder / "unbroken_state.pt")
    state_rel = max(float((end[k] - whole[k]).abs().max() / whole[k].abs().max().clamp_min(1e-12)) for k in whole)
    per_epoch = records[legs[0][0]][0]["batches_per_epoch"]
    return {
        "starts": [records[name][0]["start"] for name, _ in legs],
        "steps": len(losses),
        "max_rel_loss": _rel(losses, unbroken_losses),
        "max_rel_state": state_rel,
        "state_tensors": len(whole),
        "same_keys": sorted(end) == sorted(whole),
        "rows_trained": len(trained),
        "rows_distinct": len(set(trained)),
        "epoch_rows": per_epoch * GLOBAL_BATCH,
    }


def memory(out: Path) -> dict[str, Any]:
    """Peak RSS per rank at 1, 2, 4, 8 ranks against the estimate; the 64-rank dry run."""
    from recsys_pipe.testing import load_run
    from recsys_pipe.train.memory import RUNTIME_BYTES, dry_run_tables, estimate_memory, table_part
    from recsys_pipe.train.parallel import Topology
    from recsys_pipe.train.plan import training_plan

    run = load_run("pipeline=serial", "trainer.device=cpu", *RSS_RUN)
    plan = training_plan(run)
    rows = []
    for ranks in (1, 2, 4, 8):
        estimated = estimate_memory(run, plan, Topology(ranks, ranks, "cpu"))
        assert estimated is not None
        estimate = estimated.largest.peak
        row: dict[str, Any] = {"ranks": ranks, "estimate_mib": estimate / 2**20}
        for allocator, env in (("default", {}), ("fixed_mmap", FIXED_MMAP)):
            folder = out / f"rss_{allocator}_{ranks}"
            folder.mkdir(exist_ok=True)
            launch(folder, 1, ranks, "rss", str(folder), "10", *RSS_RUN, env=env)
            peaks = [_read(folder / f"rss_rank{r}.json")["peak_rss"] / 2**20 for r in range(ranks)]
            row[allocator] = {"min_mib": min(peaks), "max_mib": max(peaks)}
            row[allocator]["worst_rel"] = max(abs(estimate / 2**20 - p) / p for p in peaks)
        rows.append(row)
    runtime = out / "rss_runtime"
    runtime.mkdir(exist_ok=True)
    launch(runtime, 1, 1, "rss", str(runtime), "10", *RUNTIME_RUN, env=FIXED_MMAP)
    measured_runtime = _read(runtime / "rss_rank0.json")["peak_rss"] / 2**20
    dry = {}
    for sharding in ("row_wise", "table_row_wise", "column_wise", "table_wise", "planner"):
        big = load_run(*DRY_RUN, f"model.sharding={sharding}")
        topology = Topology(64, 8, "cuda")
        estimated = estimate_memory(big, training_plan(big), topology)
        assert estimated is not None
        expected = table_part(estimated, 0)
        measured = dry_run_tables(big, topology, 0)
        built = measured["weights"] + measured["state"]
        rel = (built - expected) / expected
        dry[sharding] = {"estimate_mib": expected / 2**20, "built_mib": built / 2**20, "rel": rel}
    runtime_mib = {"measured": measured_runtime, "constant": RUNTIME_BYTES["cpu"] / 2**20}
    return {"rss": rows, "runtime_mib": runtime_mib, "dry_run_64": dry}


def _checks(results: dict[str, Any]) -> list[str]:
    """One line per failed check."""
    failed = []
    for case in ("dlrm", "hstu"):
        for name, v in results.get("parity", {}).get(case, {}).get("variants", {}).items():
            if v["max_rel"] > RTOL:
                failed.append(f"parity {case}/{name}: losses {v['max_rel']:.2e} from one rank's (> {RTOL})")
    for kernel in ("fused", "dense"):
        r = results.get(f"reshard_{kernel}")
        if r is None:
            continue
        if r["max_rel_loss"] > RTOL or r["max_rel_state"] > 10 * RTOL or not r["same_keys"]:
            failed.append(f"reshard {kernel}: losses {r['max_rel_loss']:.2e}, state {r['max_rel_state']:.2e}")
        if not (r["rows_trained"] == r["rows_distinct"] == r["epoch_rows"]):
            failed.append(f"reshard {kernel}: {r['rows_trained']} rows trained, {r['rows_distinct']} distinct")
    mem = results.get("memory")
    if mem is not None:
        for row in mem["rss"]:
            if row["fixed_mmap"]["worst_rel"] > RSS_TOLERANCE:
                failed.append(f"memory at {row['ranks']} ranks: estimate {row['fixed_mmap']['worst_rel']:.0%} off")
        for sharding, d in mem["dry_run_64"].items():
            if abs(d["rel"]) > TABLE_TOLERANCE:
                failed.append(f"64-rank dry run {sharding}: table part {d['rel']:+.1%} off")
    return failed


def render(results: dict[str, Any], timing: dict[str, Any]) -> str:
    """The results section of docs/operations/multi-node.md."""
    lines = [
        f"Measured {date.today().isoformat()} by `recsys-bench multi_host` on the development machine "
        f"({os.cpu_count()} cores, {platform.machine()}, no GPU), **busy**: shared with other jobs (load "
        f"{timing['load_before']:.1f} before, {timing['load_after']:.1f} after). Rerun it on a quiet machine to "
        "compare.",
        "",
        "| part | wall | CPU (all processes) |",
        "|---|---|---|",
    ]
    lines += [f"| {p} | {t['wall_s']:.0f} s | {t['cpu_s']:.0f} s |" for p, t in timing["parts"].items()]
    if "parity" in results:
        for case, title in (("dlrm", "DLRM, 8 ranks as 2 hosts x 4"), ("hstu", "HSTU ranking, 4 ranks as 2 hosts x 2")):
            r = results["parity"][case]
            lines += ["", f"**{title}**, {r['steps']} steps against one rank on the same global batches:", ""]
            lines += ["| tables | max relative loss difference | seconds (20 steps, busy) |", "|---|---|---|"]
            lines += [f"| `{n}` | {v['max_rel']:.1e} | {v['seconds']} |" for n, v in r["variants"].items()]
    for kernel, title in (("fused", "Adagrad on the fused kernel"), ("dense", "Adam on the dense kernel")):
        r = results.get(f"reshard_{kernel}")
        if r is not None:
            lines += [
                "",
                f"**Resharded resume, {title}**: steps from {r['starts']} on 8 (`row_wise`), 4 (`table_row_wise`), "
                f"2 (`table_wise`) and 1 rank(s), {r['steps']} steps in all, against the run unbroken on one rank: "
                f"losses within {r['max_rel_loss']:.1e}, the tables and their optimizer state "
                f"({r['state_tensors']} tensors) within {r['max_rel_state']:.1e} of the largest entry; "
                f"{r['rows_trained']} rows trained, {r['rows_distinct']} distinct, of an epoch of {r['epoch_rows']}.",
            ]
    mem = results.get("memory")
    if mem is not None:
        lines += [
            "",
            "**Memory estimate against peak RSS** (DLRM, 26 tables of 50,000 x 64, row-wise, 10 steps; the "
            "largest rank's estimate against each rank's peak; glibc's default allocator, and its mmap threshold "
            "fixed at 1 MiB):",
            "",
            "| ranks | estimate MiB | peak RSS MiB (default) | worst | peak RSS MiB (fixed threshold) | worst |",
            "|---|---|---|---|---|---|",
        ]
        for row in mem["rss"]:
            d, f = row["default"], row["fixed_mmap"]
            lines.append(
                f"| {row['ranks']} | {row['estimate_mib']:.0f} | {d['min_mib']:.0f}–{d['max_mib']:.0f} | "
                f"{d['worst_rel']:.0%} | {f['min_mib']:.0f}–{f['max_mib']:.0f} | {f['worst_rel']:.0%} |"
            )
        rt = mem["runtime_mib"]
        lines += [
            "",
            f"The estimate's CPU runtime part, {rt['constant']:.0f} MiB, against a rank training DLRM with 26 tables "
            f"of 10 rows now: {rt['measured']:.0f} MiB peak RSS.",
        ]
        lines += [
            "",
            "**64 ranks (8 x 8), rank 0's tables built under torch's fake process group** (DLRM, 26 tables of 10^6 "
            "rows, row-wise Adagrad) against the estimate's table part:",
            "",
            "| tables | estimate MiB | built MiB | difference |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| `{s}` | {d['estimate_mib']:.1f} | {d['built_mib']:.1f} | {d['rel']:+.1%} |"
            for s, d in mem["dry_run_64"].items()
        ]
    return "\n".join(lines)


def write_docs(path: Path, text: str) -> None:
    """Replace the text between the `MARKERS` of `path` by `text`."""
    page = path.read_text()
    start, end = page.index(MARKERS[0]) + len(MARKERS[0]), page.index(MARKERS[1])
    path.write_text(page[:start] + "\n" + text + "\n" + page[end:])


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    self_usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime + self_usage.ru_utime + self_usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/multi_host", help="folder for the ranks' files and multi_host.json")
    parser.add_argument("--parts", default="parity,reshard,memory", help="comma-separated: parity, reshard, memory")
    parser.add_argument(
        "--docs", default="docs/operations/multi-node.md", help="the page whose results are rewritten (none: no page)"
    )
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"parity", "reshard", "memory"}
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    timing: dict[str, Any] = {"load_before": os.getloadavg()[0], "parts": {}}
    steps = {
        "parity": lambda: {"parity": parity(out)},
        "reshard": lambda: {f"reshard_{k}": reshard(out, k) for k in ("fused", "dense")},
        "memory": lambda: {"memory": memory(out)},
    }
    for part in parts:
        wall, cpu = time.perf_counter(), _cpu_seconds()
        results.update(steps[part]())
        timing["parts"][part] = {"wall_s": time.perf_counter() - wall, "cpu_s": _cpu_seconds() - cpu}
        spent = timing["parts"][part]
        print(f"{part}: {spent['wall_s']:.0f} s wall, {spent['cpu_s']:.0f} s CPU", flush=True)
    timing["load_after"] = os.getloadavg()[0]
    failed = _checks(results)
    (out / "multi_host.json").write_text(json.dumps({"results": results, "timing": timing, "failed": failed}, indent=2))
    text = render(results, timing)
    print(text)
    if args.docs != "none":
        write_docs(Path(args.docs), text)
    for line in failed:
        print(f"recsys-bench multi_host: {line}", file=sys.stderr)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
