"""Reading data at scale, side by side in one run: the Parquet loaders against raw pyarrow decoding
(their bound), the in-memory `data=criteo` source and the converter, and training on each source.

The benchmark generates its own data under a temporary directory (`--dir` keeps it):
Criteo-shaped Parquet (13 integer and 26 id columns, row groups of 131,072, files of 2.5M rows) of
each `--sizes` (default 5M and 20M rows), a Criteo TSV of `--tsv-rows` rows (1M) with its
conversion, and sequence Parquet of `--seq-users` users with `--seq-len` items each (200), with a
"user item" file of its first `--seq-text-users` users for `data=sequences`, and a ratings CSV of
`--rank-ratings` ratings (2M) by `--rank-users` users with its `recsys-data convert sequences
--windows --rank-seq-len` (64) Parquet for HSTU ranking.

Each measurement runs in a fresh process (`--measure`), so its peak memory is its own:

- `pyarrow`: `ParquetFile.iter_batches(batch)` over the files, every column to numpy (the bound).
- `loader`: `data=parquet` batches in the trainer's format (KJT, dense, labels), one rank, one
  DataLoader worker, `data.shuffle=true` with the default window; at each size, once as is and
  once with glibc's mmap threshold fixed (`MALLOC_MMAP_THRESHOLD_`, see `FIXED_MMAP`): the peak
  memory's flatness across sizes is read on the latter.
- `criteo_memory`: `data=criteo` on the TSV: parse (pyarrow), hold, batch.
- `convert`: `recsys-data convert criteo` of the TSV.
- `seq_pyarrow` / `seq_loader`: the same pair for `data=parquet_sequences` (length-200 users);
  the loader with one DataLoader worker and with two.
- `train_dlrm`: DLRM trained on the TSV's rows through `data=criteo` and through `data=parquet`
  (its conversion), `--train-steps` timed steps after a warm-up, alternated `--reps` times, one
  DataLoader worker each.
- `train_sasrec`: SASRec (the retrieval main job) through `data=sequences` and
  `data=parquet_sequences` on the same users.
- `rank_memory` / `rank_loader`: HSTU ranking windows through `data=movielens` on the ratings CSV
  (parse, hold, collate) and through `data=parquet_sequences` on its windowed conversion, one
  DataLoader worker each, `data.shuffle=true`.
- `train_hstu`: `model=hstu_small` trained through the two, as `train_dlrm`.

Reported per measurement: samples/s (per rank: everything runs on one rank), time to the first
batch (from building the source, the imports excluded, to the first batch), the rank's peak memory
(`MemoryWatch`: the process's RSS plus its DataLoader workers' USS, sampled together, so no page
is counted twice; the process's peak RSS and the workers' USS and shared pages are in the JSON
line too) and bytes per sample (on disk for files; held in memory for `criteo_memory`). The
ratios the targets name come last (docs/benchmarks.md), then one JSON line. `--quick` shrinks
everything and measures in one process (its peak memory is then cumulative): a smoke test of the
report's structure that the test suite runs.

    recsys-bench data                      # the full run (several minutes; run it on an idle machine)
    recsys-bench data --only loader,pyarrow --sizes 5000000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from recsys_pipe.bench.common import format_summary, summary

PARTS = (
    "convert",
    "criteo_memory",
    "pyarrow",
    "loader",
    "seq_pyarrow",
    "seq_loader",
    "train_dlrm",
    "train_sasrec",
    "rank_memory",
    "rank_loader",
    "train_hstu",
)
#: candidates per HSTU ranking window (data.num_candidates)
RANK_CANDIDATES = 4
ROWS_PER_FILE = 2_500_000
#: the rows whose process runs with glibc's mmap threshold fixed at its default, 128 KiB. By default
#: glibc raises the threshold as large blocks are freed, so later batch-sized tensors come from the
#: heap, which fragments: the main process's peak RSS then varies by ~100 MiB from run to run
#: (measured 383-499 MiB on the same 20M rows), more than the data set moves it. Fixed, the same
#: runs peak at 331-335 MiB at the same speed; the rows with and without it show both.
FIXED_MMAP = "glibc mmap threshold fixed"
#: DataLoader workers of the sequence loader's rows: one (the bound of a worker: row groups, then
#: negatives, ~8 µs per length-200 user) and one per core of the 2-core reference machine
SEQ_LOADER_WORKERS = (1, 2)
ROW_GROUP = 131_072


# -- data generation ------------------------------------------------------------------------------


def _criteo_columns(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Criteo-shaped rows: skewed counts (some empty: 0), 32-bit ids, a learnable-ish label."""
    from recsys_pipe.data.text.criteo_tsv import CATEGORICAL_KEYS, DENSE_NAMES

    cols: dict[str, np.ndarray] = {}
    counts = np.floor(np.exp(rng.normal(1.5, 1.5, (len(DENSE_NAMES), n)))).astype(np.int64)
    counts[rng.random(counts.shape) < 0.15] = 0
    ids = rng.integers(0, 2**32, (len(CATEGORICAL_KEYS), n), dtype=np.int64)
    cols["label"] = (rng.random(n) < 0.25 + 0.2 * (ids[0] % 2)).astype(np.int8)
    cols.update({name: counts[j] for j, name in enumerate(DENSE_NAMES)})
    cols.update({name: ids[j] for j, name in enumerate(CATEGORICAL_KEYS)})
    return cols


def write_criteo_parquet(directory: Path, rows: int, seed: int = 0) -> None:
    """`rows` Criteo-shaped rows as Parquet files of `ROWS_PER_FILE` rows, as the converter writes them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recsys_pipe.data.tools.convert import criteo_schema

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for index, start in enumerate(range(0, rows, ROWS_PER_FILE)):
        size = min(ROWS_PER_FILE, rows - start)
        with pq.ParquetWriter(directory / f"part-{index:05d}.parquet", criteo_schema(), use_dictionary=False) as w:
            for offset in range(0, size, ROW_GROUP):
                cols = _criteo_columns(rng, min(ROW_GROUP, size - offset))
                w.write_table(pa.table(cols, schema=criteo_schema()), row_group_size=ROW_GROUP)


def write_criteo_tsv(path: Path, rows: int, seed: int = 1) -> None:
    """`rows` Criteo-shaped rows as a TSV (empty counts as empty fields, 8-digit hexadecimal ids)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    digits = np.frombuffer(b"0123456789abcdef", np.uint8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        for start in range(0, rows, ROW_GROUP):
            cols = _criteo_columns(rng, min(ROW_GROUP, rows - start))
            table = {}
            for name, values in cols.items():
                if name.startswith("cat_"):
                    nibbles = (values[:, None] >> np.arange(28, -1, -4)) & 0xF  # 8 hex digits, vectorised
                    hexed = pa.FixedSizeBinaryArray.from_buffers(
                        pa.binary(8), len(values), [None, pa.py_buffer(digits[nibbles].tobytes())]
                    )
                    table[name] = hexed.cast(pa.binary()).cast(pa.string())
                elif name == "label":
                    table[name] = pa.array(values.astype(np.int64))
                else:
                    strings = pc.cast(pa.array(values), pa.string())
                    table[name] = pc.if_else(pa.array(values == 0), "", strings)
            options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
            pacsv.write_csv(pa.table(table), f, options)


def write_sequences(directory: Path, users: int, length: int, text_users: int, seed: int = 2) -> None:
    """`users` users of `length` items each as sequence Parquet (with the item vocabulary), and the
    first `text_users` of them as a "user item" file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recsys_pipe.data.parquet.decode import item_vocab_metadata
    from recsys_pipe.data.tools.convert import sequence_schema

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    num_items = 50_000
    schema = sequence_schema(False, False).with_metadata(item_vocab_metadata(np.arange(1, num_items + 1)))
    with pq.ParquetWriter(directory / "sequences.parquet", schema) as writer:
        for start in range(0, users, 16_384):
            n = min(16_384, users - start)
            items = rng.zipf(1.2, n * length) % num_items + 1
            offsets = pa.array(np.arange(0, n * length + 1, length, dtype=np.int32))
            lists = pa.ListArray.from_arrays(offsets, pa.array(items.astype(np.int64)))
            writer.write_table(pa.table([pa.array(np.arange(start, start + n)), lists], schema=schema))
            if start == 0:
                pairs = np.stack([np.repeat(np.arange(start, start + n), length), items], 1)[: text_users * length]
                np.savetxt(directory / "sequences.txt", pairs, fmt="%d")


def write_ratings(directory: Path, ratings: int, users: int, seq_len: int, seed: int = 3) -> None:
    """A MovieLens-style ratings CSV (`userId,movieId,rating,timestamp`, half stars) of `ratings`
    ratings by `users` users, and its `convert sequences --windows seq_len` Parquet under `pq/`."""
    from recsys_pipe.data.tools.convert import convert_sequences

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    columns = [
        rng.integers(1, users + 1, ratings),
        rng.zipf(1.2, ratings) % 30_000 + 1,
        rng.integers(1, 11, ratings) / 2,
        rng.integers(10**9, 2 * 10**9, ratings),
    ]
    with open(directory / "ratings.csv", "w") as f:
        f.write("userId,movieId,rating,timestamp\n")
        np.savetxt(f, np.stack(columns, 1), fmt=["%d", "%d", "%.1f", "%d"], delimiter=",")
    convert_sequences(str(directory / "ratings.csv"), str(directory / "pq"), windows=seq_len,
                      num_candidates=RANK_CANDIDATES)  # fmt: skip


# -- measurements (each in its own process) ---------------------------------------------------------


def _proc_kib(path: str, fields: tuple[str, ...]) -> dict[str, int]:
    """`fields` (in KiB) of a /proc status or smaps_rollup file; {} if the process is gone."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in fields:
                    out[name] = int(rest.split()[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    return out


_ROLLUP = ("Private_Clean", "Private_Dirty", "Shared_Clean", "Shared_Dirty")


def _children(pid: int) -> list[int]:
    """The live child processes of `pid` (its DataLoader workers), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


class MemoryWatch:
    """The rank's memory while a measurement runs, without counting a page twice.

    A forked DataLoader worker shares pages with this process (those it has not written, and
    the shared memory batches cross in), so adding the two processes' RSS counts those pages
    twice. Every `interval` seconds a thread reads this process's RSS and, from
    `/proc/PID/smaps_rollup`, each worker's USS (pages only it maps: Private_Clean +
    Private_Dirty) and its shared pages (Shared_Clean + Shared_Dirty, nearly all of them this
    process's). The rank's peak is the largest sum of this process's RSS and its workers' USS
    in one sample, and at least this process's own peak RSS (VmHWM). Workers are looked up
    among this process's children every `rescan` seconds. A page a worker shares only with a
    process other than this one (none here) would go uncounted."""

    def __init__(self, interval: float = 0.1, rescan: float = 1.0) -> None:
        import threading

        self.interval, self.rescan = interval, rescan
        self.peak_rank = self.peak_uss = self.peak_shared = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self, workers: list[int]) -> None:
        rss = _proc_kib("/proc/self/status", ("VmRSS",)).get("VmRSS", 0)
        uss = shared = 0
        for pid in workers:
            kib = _proc_kib(
                f"/proc/{pid}/smaps_rollup", ("Private_Clean", "Private_Dirty", "Shared_Clean", "Shared_Dirty")
            )
            uss += kib.get("Private_Clean", 0) + kib.get("Private_Dirty", 0)
            shared += kib.get("Shared_Clean", 0) + kib.get("Shared_Dirty", 0)
        self.peak_rank = max(self.peak_rank, rss + uss)
        self.peak_uss, self.peak_shared = max(self.peak_uss, uss), max(self.peak_shared, shared)

    def _run(self) -> None:
        workers: list[int] = []
        last_scan = -self.rescan
        while True:
            now = time.perf_counter()
            if now - last_scan >= self.rescan:
                workers, last_scan = _children(os.getpid()), now
            self.sample(workers)
            if self._stop.wait(self.interval):
                return

    def figures(self) -> dict[str, float]:
        """Peaks in MiB: the rank's (`peak_memory_mib`), this process's RSS (`peak_main_rss_mib`,
        exact: VmHWM), its workers' USS and shared pages (sampled)."""
        hwm = _proc_kib("/proc/self/status", ("VmHWM",)).get("VmHWM", 0)
        return {
            "peak_memory_mib": round(max(self.peak_rank, hwm) / 1024, 1),
            "peak_main_rss_mib": round(hwm / 1024, 1),
            "peak_worker_uss_mib": round(self.peak_uss / 1024, 1),
            "peak_worker_shared_mib": round(self.peak_shared / 1024, 1),
        }


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _iterate(batches: Any, start: float, limit: int | None = None) -> dict[str, float]:
    """Samples/s over the batches after the first, and the time to the first."""
    first = None
    samples = 0
    t = start
    for batch in batches:
        n = int(batch.sample_ids.numel()) if hasattr(batch, "sample_ids") else int(batch)
        if first is None:
            first = time.perf_counter() - start
            t = time.perf_counter()
            continue
        samples += n
        if limit is not None and samples >= limit:
            break
    seconds = time.perf_counter() - t
    return {"first_batch_s": round(first or 0.0, 4), "samples": samples, "samples_per_s": samples / max(seconds, 1e-9)}


def _pyarrow_batches(path: Path, batch_size: int, sequences: bool):
    import pyarrow.parquet as pq

    for file in sorted(Path(path).glob("*.parquet")) if path.is_dir() else [path]:
        for record in pq.ParquetFile(file).iter_batches(batch_size):
            for column in record.columns:
                if sequences and hasattr(column, "values"):
                    column.values.to_numpy()
                    column.offsets.to_numpy()
                else:
                    column.to_numpy()
            yield record.num_rows


def measure(kind: str, path: Path, batch_size: int, extra: dict[str, Any]) -> dict[str, Any]:
    """One measurement in this process (see the module docstring). The clock of the first batch
    starts after the imports: what it measures is the source's own start (metadata, workers)."""
    import torch  # noqa: F401  (imported before the clock starts)

    import recsys_pipe.data.in_memory.criteo
    import recsys_pipe.data.parquet.sequences
    import recsys_pipe.data.parquet.tabular  # noqa: F401

    with MemoryWatch() as watch:
        out = _measure(kind, path, batch_size, extra)
    out.update(watch.figures())
    return out


def _measure(kind: str, path: Path, batch_size: int, extra: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    out: dict[str, Any]
    if kind in ("pyarrow", "seq_pyarrow"):
        out = _iterate(_pyarrow_batches(path, batch_size, kind == "seq_pyarrow"), start)
        out["bytes_per_sample"] = _disk_bytes(path) / max(out["samples"] + batch_size, 1)
    elif kind in ("loader", "seq_loader"):
        from recsys_pipe.data import RankData
        from recsys_pipe.data.parquet.sequences import ParquetSequencesDataConfig
        from recsys_pipe.data.parquet.tabular import ParquetDataConfig

        keys = {"path": str(path), "batch_size": batch_size, "num_workers": extra.get("workers", 1), "shuffle": True}
        if kind == "loader":
            cfg: Any = ParquetDataConfig(**keys)
        else:
            cfg = ParquetSequencesDataConfig(**keys, max_seq_len=extra["seq_len"])
        data = RankData(cfg, 0, 1)
        out = _iterate(data.train_loader(), start)
        out["bytes_per_sample"] = _disk_bytes(path) / max(out["samples"] + batch_size, 1)
    elif kind in ("rank_memory", "rank_loader"):
        from recsys_pipe.data import MovieLensDataConfig, RankData, SequenceDataConfig
        from recsys_pipe.data.parquet.sequences import ParquetSequencesDataConfig

        keys = {"path": str(path), "batch_size": batch_size, "num_workers": 1, "shuffle": True}
        before = _rss_mib()
        if kind == "rank_memory":
            cfg = MovieLensDataConfig(**keys, max_seq_len=extra["seq_len"], num_candidates=RANK_CANDIDATES)
        else:
            cfg = ParquetSequencesDataConfig(**keys).as_kind(SequenceDataConfig)
        data = RankData(cfg, 0, 1)
        held = (_rss_mib() - before) * 2**20
        out = _iterate(data.train_loader(), start)
        windows = data.batches_per_epoch * batch_size
        out["bytes_per_sample"] = held / windows if kind == "rank_memory" else _disk_bytes(path) / windows
    elif kind == "criteo_memory":
        from recsys_pipe.data import CriteoDataConfig, RankData

        before = _rss_mib()
        data = RankData(CriteoDataConfig(path=str(path), batch_size=batch_size), 0, 1)
        held = (_rss_mib() - before) * 2**20
        out = _iterate(data.train_loader(), start)
        out["bytes_per_sample"] = held / len(data.dataset)
    elif kind == "convert":
        from recsys_pipe.data.tools.convert import convert_criteo

        (converted,) = convert_criteo([str(path)], extra["dst"], overwrite=True)
        seconds = time.perf_counter() - start
        out = {"first_batch_s": None, "samples": converted.rows, "samples_per_s": converted.rows / seconds}
        out["bytes_per_sample"] = Path(converted.path).stat().st_size / converted.rows
    elif kind in ("train_dlrm", "train_sasrec", "train_hstu"):
        out = _train(extra["overrides"], extra["warmup"], extra["steps"], batch_size, start)
    else:
        raise ValueError(f"unknown measurement {kind!r}")
    return out


def _train(overrides: list[str], warmup: int, steps: int, batch_size: int, start: float) -> dict[str, Any]:
    from recsys_pipe.bench.timing import TAIL, StepTimer, Window
    from recsys_pipe.runtime import init_distributed
    from recsys_pipe.testing import load_run
    from recsys_pipe.train import Trainer, build_parts, training_plan

    info = init_distributed("cpu", "gloo")
    total = warmup + steps + TAIL
    common = [
        "pipeline=serial",
        "trainer.device=cpu",
        "trainer.epochs=1000",
        f"trainer.max_steps={total}",
        "trainer.eval_every=0",
        "trainer.eval_batches=0",
        "trainer.progress_bar=false",
        "trainer.tensorboard=false",
        f"trainer.log_every={total + 1}",
        f"data.batch_size={batch_size}",
    ]
    run = load_run(*common, *overrides)
    plan = training_plan(run)
    trainer = Trainer(build_parts(run, plan, info))
    try:
        first = warmup + plan.task_graph.max_lookahead
        window = Window(info.device)
        trainer.plan_runner.observer = StepTimer(window, first, first + steps)
        trainer.fit()
        seconds = window.figures()["seconds"]
    finally:
        trainer.close()
    return {
        "first_batch_s": None,
        "samples": steps * batch_size,
        "samples_per_s": steps * batch_size / seconds,
        "bytes_per_sample": None,
        "setup_and_run_s": round(time.perf_counter() - start, 2),
    }


def _spawn(kind: str, path: Path, batch_size: int, extra: dict[str, Any], threads: int) -> dict[str, Any]:
    """Run `measure` in a fresh interpreter; its last stdout line is the result."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **extra.get("env", {})}
    argv = [sys.executable, "-m", "recsys_pipe.bench.data", "--measure", kind, "--path", str(path)]
    argv += ["--batch-size", str(batch_size), "--extra", json.dumps(extra)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement {kind} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the run ----------------------------------------------------------------------------------------


def _sizes(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny data, one repetition: a smoke test in seconds")
    parser.add_argument("--sizes", default="5000000,20000000", help="Criteo Parquet rows, comma-separated")
    parser.add_argument("--tsv-rows", type=int, default=1_000_000, help="rows of the Criteo TSV")
    parser.add_argument("--seq-users", type=int, default=200_000, help="users of the sequence Parquet")
    parser.add_argument("--seq-text-users", type=int, default=20_000, help="users of the 'user item' file")
    parser.add_argument("--seq-len", type=int, default=200, help="items per user")
    parser.add_argument("--rank-ratings", type=int, default=2_000_000, help="ratings of the HSTU ranking CSV")
    parser.add_argument("--rank-users", type=int, default=20_000, help="users of the HSTU ranking CSV")
    parser.add_argument("--rank-seq-len", type=int, default=64, help="HSTU ranking window length")
    parser.add_argument("--batch-size", type=int, default=8192, help="rows per batch (tabular)")
    parser.add_argument("--seq-batch-size", type=int, default=256, help="users per batch (sequences)")
    parser.add_argument("--train-batch-size", type=int, default=2048, help="rows per DLRM training batch")
    parser.add_argument("--train-steps", type=int, default=80, help="timed training steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed training steps first")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measurement (interleaved)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--only", default=",".join(PARTS), help=f"parts to run, of {','.join(PARTS)}")
    parser.add_argument("--dir", default=None, help="where the data is generated (kept; default: a temp dir)")
    parser.add_argument("--generate-only", action="store_true", help="generate the data under --dir, measure nothing")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        result = measure(args.measure, Path(args.path), args.batch_size, json.loads(args.extra))
        print(json.dumps(result))
        return
    if args.quick:
        args.sizes, args.tsv_rows, args.seq_users, args.seq_text_users = "20000,40000", 20_000, 600, 300
        args.batch_size, args.seq_batch_size, args.train_batch_size = 1024, 64, 256
        args.train_steps, args.warmup, args.reps, args.seq_len = 2, 1, 1, 20
        args.rank_ratings, args.rank_users, args.rank_seq_len = 20_000, 400, 16
    parts = [p for p in args.only.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    if args.dir:
        run(args, parts, Path(args.dir))
    else:
        with tempfile.TemporaryDirectory(prefix="recsys-bench-data-") as tmp:
            run(args, parts, Path(tmp))


def run(args: argparse.Namespace, parts: list[str], root: Path) -> None:
    """Generate what `parts` need under `root`, measure, print the table, the ratios and the JSON line."""
    sizes = _sizes(args.sizes)
    t = time.perf_counter()
    generate(args, parts, root, sizes)
    print(f"data generated in {time.perf_counter() - t:.1f} s under {root}", flush=True)
    if args.generate_only:
        return
    jobs = _jobs(args, parts, root, sizes)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in jobs}
    for rep in range(args.reps):
        for name, kind, path, batch, extra in jobs if rep % 2 == 0 else jobs[::-1]:
            if args.quick:  # one process for everything: a smoke test of the structure, not of memory
                results[name].append(measure(kind, path, batch, extra))
            else:
                results[name].append(_spawn(kind, path, batch, extra, args.threads))
    report = _report(results, args, sizes)
    _print(report)
    print(json.dumps(report))


def generate(args: argparse.Namespace, parts: list[str], root: Path, sizes: list[int]) -> None:
    """Write under `root` the data sets `parts` read that are not there yet: Criteo Parquet of
    every size (the smaller ones the biggest one's first files, linked), the Criteo TSV and its
    conversion, the sequences and the ratings."""
    biggest = root / f"criteo_{max(sizes)}"
    if {"pyarrow", "loader"} & set(parts) and not biggest.exists():
        write_criteo_parquet(biggest, max(sizes))
    for size in sizes:  # the smaller data sets are the biggest one's first files, linked
        d = root / f"criteo_{size}"
        if size != max(sizes) and {"pyarrow", "loader"} & set(parts) and not d.exists():
            if size % ROWS_PER_FILE and size > ROWS_PER_FILE:
                raise SystemExit(f"--sizes: {size} is not a multiple of {ROWS_PER_FILE} rows per file")
            d.mkdir()
            if size <= ROWS_PER_FILE:
                write_criteo_parquet(d, size)
            else:
                for k in range(size // ROWS_PER_FILE):
                    os.link(biggest / f"part-{k:05d}.parquet", d / f"part-{k:05d}.parquet")
    tsv = root / "criteo.tsv"
    if {"convert", "criteo_memory", "train_dlrm"} & set(parts) and not tsv.exists():
        write_criteo_tsv(tsv, args.tsv_rows)
    converted = root / "criteo_tsv_parquet"
    if "train_dlrm" in parts and not converted.exists():
        from recsys_pipe.data.tools.convert import convert_criteo

        convert_criteo([str(tsv)], str(converted))
    seqs = root / "sequences"
    if {"seq_pyarrow", "seq_loader", "train_sasrec"} & set(parts) and not seqs.exists():
        write_sequences(seqs, args.seq_users, args.seq_len, args.seq_text_users)
    ranking = root / "ratings"
    if {"rank_memory", "rank_loader", "train_hstu"} & set(parts) and not ranking.exists():
        write_ratings(ranking, args.rank_ratings, args.rank_users, args.rank_seq_len)


def _jobs(
    args: argparse.Namespace, parts: list[str], root: Path, sizes: list[int]
) -> list[tuple[str, str, Path, int, dict[str, Any]]]:
    """The measurements `parts` ask for, in order: (row name, kind, path, batch size, extra)."""
    seqs, ranking = root / "sequences", root / "ratings"
    tsv, converted = root / "criteo.tsv", root / "criteo_tsv_parquet"
    jobs: list[tuple[str, str, Path, int, dict[str, Any]]] = []  # (row name, kind, path, batch, extra)
    if "convert" in parts:
        jobs.append(("convert criteo (TSV -> Parquet)", "convert", tsv, 0, {"dst": str(root / "converted")}))
    if "criteo_memory" in parts:
        jobs.append((f"data=criteo in memory, {args.tsv_rows} rows", "criteo_memory", tsv, args.batch_size, {}))
    for size in sizes:
        if "pyarrow" in parts:
            jobs.append((f"raw pyarrow, {size} rows", "pyarrow", root / f"criteo_{size}", args.batch_size, {}))
        if "loader" in parts:
            jobs.append((f"data=parquet loader, {size} rows", "loader", root / f"criteo_{size}", args.batch_size, {}))
            jobs.append((f"data=parquet loader, {size} rows, {FIXED_MMAP}", "loader", root / f"criteo_{size}",
                         args.batch_size, {"env": {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}}))  # fmt: skip
    seq_file = seqs / "sequences.parquet"
    if "seq_pyarrow" in parts:
        jobs.append((f"raw pyarrow, sequences of {args.seq_len}", "seq_pyarrow", seq_file, args.seq_batch_size, {}))
    if "seq_loader" in parts:
        for workers in SEQ_LOADER_WORKERS:
            name = f"data=parquet_sequences loader, length {args.seq_len}, {workers} worker{'s' * (workers > 1)}"
            extra = {"seq_len": args.seq_len, "workers": workers}
            jobs.append((name, "seq_loader", seq_file, args.seq_batch_size, extra))
    train = {"warmup": args.warmup, "steps": args.train_steps}
    if "train_dlrm" in parts:
        # one DataLoader worker each: the data is prepared beside the training thread, as a run would
        dlrm = ["model=dlrm", f"data.num_embeddings={1000 if args.quick else 100_000}", "data.num_workers=1"]
        jobs.append(("train DLRM, data=criteo", "train_dlrm", tsv, args.train_batch_size,
                     {**train, "overrides": [*dlrm, "data=criteo", f"data.path={tsv}"]}))  # fmt: skip
        jobs.append(("train DLRM, data=parquet", "train_dlrm", converted, args.train_batch_size,
                     {**train, "overrides": [*dlrm, "data=parquet", f"data.path={converted}"]}))  # fmt: skip
    if "train_sasrec" in parts:
        sasrec = ["model=sasrec", f"model.max_seq_len={args.seq_len}", f"data.max_seq_len={args.seq_len}"]
        sasrec += ["data.eval_negatives=10", "data.full_eval=false", "data.num_workers=1"]
        text = seqs / "sequences.txt"
        jobs.append(("train SASRec, data=sequences", "train_sasrec", text, args.seq_batch_size,
                     {**train, "overrides": [*sasrec, "data=sequences", f"data.path={text}"]}))  # fmt: skip
        jobs.append(("train SASRec, data=parquet_sequences", "train_sasrec", seq_file, args.seq_batch_size,
                     {**train, "overrides": [*sasrec, "data=parquet_sequences", f"data.path={seq_file}"]}))  # fmt: skip
    ratings, windows = ranking / "ratings.csv", ranking / "pq" / "ratings.parquet"
    length = args.rank_seq_len
    if "rank_memory" in parts:
        jobs.append((f"data=movielens in memory, windows of {length}", "rank_memory", ratings, args.seq_batch_size,
                     {"seq_len": length}))  # fmt: skip
    if "rank_loader" in parts:
        jobs.append((f"data=parquet_sequences HSTU ranking loader, windows of {length}", "rank_loader", windows,
                     args.seq_batch_size, {}))  # fmt: skip
    if "train_hstu" in parts:
        hstu = ["model=hstu_small", f"model.max_seq_len={length}", "data.num_workers=1", "data.shuffle=true"]
        movielens = ["data=movielens", f"data.path={ratings}", f"data.max_seq_len={length}",
                     f"data.num_candidates={RANK_CANDIDATES}"]  # fmt: skip
        jobs.append(("train HSTU, data=movielens", "train_hstu", ratings, args.seq_batch_size,
                     {**train, "overrides": [*hstu, *movielens]}))  # fmt: skip
        jobs.append(("train HSTU, data=parquet_sequences", "train_hstu", windows, args.seq_batch_size,
                     {**train, "overrides": [*hstu, "data=parquet_sequences", f"data.path={windows}"]}))  # fmt: skip
    return jobs


def _report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, sizes: list[int]) -> dict[str, Any]:
    """The report: each row's medians (min-max), the ratios of the targets and their limits."""
    rows = _rows(results)
    ratios = _ratios(rows, args, sizes)
    return {
        "rows": rows,
        "ratios": {k: v for k, v in ratios.items() if v is not None},
        "targets": {k: TARGETS[k] for k, v in ratios.items() if v is not None},
        "config": {k: v for k, v in vars(args).items() if k not in ("measure", "path", "extra")},
        "cpus": os.cpu_count(),
    }


def _rows(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per row, the median (min-max) of each figure its runs measured."""
    rows: dict[str, Any] = {}
    for name, runs in results.items():
        row: dict[str, Any] = {}
        for key in (
            "samples_per_s",
            "first_batch_s",
            "peak_memory_mib",
            "peak_main_rss_mib",
            "peak_worker_uss_mib",
            "peak_worker_shared_mib",
            "bytes_per_sample",
        ):
            values = [r[key] for r in runs if r.get(key) is not None]
            if values:
                row[key] = summary(values, 4 if key == "first_batch_s" else 1)
        rows[name] = row
    return rows


def _ratios(rows: dict[str, Any], args: argparse.Namespace, sizes: list[int]) -> dict[str, float | None]:
    """The figures the targets judge (`TARGETS`), None where their rows did not run."""

    def median(name: str, key: str = "samples_per_s") -> float | None:
        return rows.get(name, {}).get(key, {}).get("median")

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    big, small = max(sizes), min(sizes)
    loader_big = f"data=parquet loader, {big} rows"
    return {
        "loader_samples_per_s": median(loader_big),
        "loader_over_raw_pyarrow": ratio(median(loader_big), median(f"raw pyarrow, {big} rows")),
        "sequence_loader_samples_per_s": median(f"data=parquet_sequences loader, length {args.seq_len}, 2 workers"),
        "sequence_loader_one_worker_samples_per_s": median(
            f"data=parquet_sequences loader, length {args.seq_len}, 1 worker"
        ),
        "train_dlrm_parquet_over_memory": ratio(median("train DLRM, data=parquet"), median("train DLRM, data=criteo")),
        "train_sasrec_parquet_over_text": ratio(
            median("train SASRec, data=parquet_sequences"), median("train SASRec, data=sequences")
        ),
        "loader_peak_memory_mib_largest": median(loader_big, "peak_memory_mib"),
        "loader_peak_memory_largest_over_smallest": ratio(
            median(f"{loader_big}, {FIXED_MMAP}", "peak_memory_mib"),
            median(f"data=parquet loader, {small} rows, {FIXED_MMAP}", "peak_memory_mib"),
        ),
        "loader_peak_memory_largest_over_smallest_default_malloc": ratio(
            median(loader_big, "peak_memory_mib"), median(f"data=parquet loader, {small} rows", "peak_memory_mib")
        ),
        "loader_first_batch_s_largest": median(loader_big, "first_batch_s"),
        "loader_first_batch_largest_over_smallest": ratio(
            median(loader_big, "first_batch_s"), median(f"data=parquet loader, {small} rows", "first_batch_s")
        ),
        "convert_over_56000_rows_per_s": ratio(median("convert criteo (TSV -> Parquet)"), 56_000),
        "ranking_loader_over_memory": ratio(
            median(f"data=parquet_sequences HSTU ranking loader, windows of {args.rank_seq_len}"),
            median(f"data=movielens in memory, windows of {args.rank_seq_len}"),
        ),
        "train_hstu_parquet_over_memory": ratio(
            median("train HSTU, data=parquet_sequences"), median("train HSTU, data=movielens")
        ),
    }


#: the target of each ratio of the report (`_ratios`)
TARGETS = {
    "loader_samples_per_s": ">= 1,000,000",
    "loader_over_raw_pyarrow": ">= 1/1.5 = 0.667",
    "sequence_loader_samples_per_s": ">= 100,000 (data.num_workers=2, one per core here)",
    "sequence_loader_one_worker_samples_per_s": "none (what one worker decodes)",
    "train_dlrm_parquet_over_memory": ">= 0.98",
    "train_sasrec_parquet_over_text": ">= 0.98",
    "loader_peak_memory_mib_largest": "<= 1024",
    "loader_peak_memory_largest_over_smallest": "<= 1.10 (glibc's mmap threshold fixed: the data's share)",
    "loader_peak_memory_largest_over_smallest_default_malloc": "none (glibc's heap varies run to run)",
    "loader_first_batch_s_largest": "< 5",
    "loader_first_batch_largest_over_smallest": "flat (<= 1.10 + noise)",
    "convert_over_56000_rows_per_s": ">= 5",
    "ranking_loader_over_memory": ">= 1 (none set: the in-memory source is the baseline)",
    "train_hstu_parquet_over_memory": ">= 0.98",
}


_MEMORY_PARTS = ("peak_main_rss_mib", "peak_worker_uss_mib", "peak_worker_shared_mib")


def _print(report: dict[str, Any]) -> None:
    width = max(map(len, report["rows"]), default=0)
    head = "samples/s (median, min-max)     first batch s        peak memory MiB     bytes/sample"
    print(f"{'':{width}}  {head}   main RSS + worker USS (worker shared), medians")
    for name, row in report["rows"].items():
        cells = [
            format_summary(row[k]) if k in row else "-"
            for k in ("samples_per_s", "first_batch_s", "peak_memory_mib", "bytes_per_sample")
        ]
        parts = [row[k]["median"] if k in row else "-" for k in _MEMORY_PARTS]
        split = f"{parts[0]} + {parts[1]} ({parts[2]})"
        print(f"{name:{width}}  {cells[0]:30}  {cells[1]:19}  {cells[2]:18}  {cells[3]:18}  {split}")
    print("\nratios against the targets:")
    for key, value in report["ratios"].items():
        print(f"  {key} = {value}   (target {report['targets'][key]})")


if __name__ == "__main__":
    main()
