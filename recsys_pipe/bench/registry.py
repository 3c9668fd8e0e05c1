"""The benchmarks and report tools `recsys-bench` runs: name -> module and a one-line summary.

Names only, no imports: `recsys-bench --help` lists them without loading torch or the training
stack, and each benchmark imports what it needs when it runs.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["BENCHMARKS", "Benchmark"]


class Benchmark(NamedTuple):
    """One entry of `BENCHMARKS`: the module run as `python -m module`, and what it measures."""

    module: str
    summary: str


BENCHMARKS: dict[str, Benchmark] = {
    "engine": Benchmark(
        "recsys_pipe.bench.engine", "the engine's own cost per task and per step, overlap of thread groups"
    ),
    "train": Benchmark(
        "recsys_pipe.bench.train",
        "the shipped plans against torchrec's pipelines: samples/s, CPU, memory, engine cost (2 ranks)",
    ),
    "shuffle": Benchmark("recsys_pipe.bench.shuffle", "balanced batches: per-rank imbalance and throughput (2 ranks)"),
    "simulator": Benchmark("recsys_pipe.bench.simulator", "the plan simulator's predictions against measured steps"),
    "pp": Benchmark(
        "recsys_pipe.bench.pp", "pipeline-parallel schedules: our engine against torch.distributed.pipelining (2 ranks)"
    ),
    "gpu": Benchmark("recsys_pipe.bench.gpu", "overlap on CUDA streams (a GPU; --device cpu: a smoke test)"),
    "engine_costs": Benchmark(
        "recsys_pipe.bench.engine_costs",
        "the engine's per-task device costs, each alone: stream entry, event record and wait, thread hand-offs",
    ),
    "sasrec": Benchmark(
        "recsys_pipe.bench.sasrec", "SASRec training throughput against the reference PyTorch implementation"
    ),
    "hstu": Benchmark(
        "recsys_pipe.bench.hstu", "HSTU training throughput against generative-recommenders' research HSTU"
    ),
    "hstu_train_reference": Benchmark(
        "recsys_pipe.bench.hstu_train_reference",
        "train generative-recommenders' HSTU on a sequences file, evaluated under our protocols",
    ),
    "retrieval_report": Benchmark(
        "recsys_pipe.bench.retrieval_report", "summary of a retrieval reproduction (scripts/reproduce_games.sh)"
    ),
    "engine_example": Benchmark(
        "recsys_pipe.bench.engine_example", "a small pipelined program written with the engine alone"
    ),
    "data": Benchmark(
        "recsys_pipe.bench.data",
        "the Parquet loaders against raw pyarrow, the in-memory Criteo source, the converter, training on each",
    ),
    "bias_lookup": Benchmark(
        "recsys_pipe.bench.bias_lookup", "HSTU's attention-bias lookup: indexing's backward against a sorted sum"
    ),
    "multi_host": Benchmark(
        "recsys_pipe.bench.multi_host",
        "8 ranks as 2 hosts x 4: every sharding type against one rank, resharded resumes, memory estimate vs RSS",
    ),
    "hstu_gpu": Benchmark(
        "recsys_pipe.bench.hstu_gpu",
        "HSTU at production sizes: MFU, samples/s, CPU/GPU ms per step; padded vs Triton attention (a GPU)",
    ),
    "compare": Benchmark(
        "recsys_pipe.bench.compare",
        "before and after: a benchmark run alternately on this tree and on a baseline (a git ref), figures paired",
    ),
    "raw_ids": Benchmark(
        "recsys_pipe.bench.raw_ids",
        "ids: managed (each eviction policy) vs hash and modulo on a skewed, drifting id stream: AUC, speed, memory",
    ),
    "compile": Benchmark(
        "recsys_pipe.bench.compile", "trainer.compile=true against eager: ms/step, compile time, loss deviation"
    ),
}
