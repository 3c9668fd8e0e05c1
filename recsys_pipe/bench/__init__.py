"""The benchmarks: one module per benchmark, each run as `python -m recsys_pipe.bench.<name>` or
`recsys-bench <name>` (`recsys-bench --help` lists them; docs/benchmarks.md says what each
measures).

This package sits at the CLI layer: its benchmarks may import every other package. Importing the
package itself loads only the standard library, so the engine and GPU benchmarks run where torch
is the only other package installed.

- `BENCHMARKS` / `Benchmark`: the registry, name -> module and summary.
- `summary`, `format_summary`, `reexec_under_torchrun`, `one_thread_per_rank`, `run_ranks`: what the benchmarks
  share (`recsys_pipe.bench.common`).
- `main`: the `recsys-bench` console script.
"""

from recsys_pipe.bench.cli import main
from recsys_pipe.bench.common import format_summary, one_thread_per_rank, reexec_under_torchrun, run_ranks, summary
from recsys_pipe.bench.registry import BENCHMARKS, Benchmark

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "format_summary",
    "main",
    "one_thread_per_rank",
    "reexec_under_torchrun",
    "run_ranks",
    "summary",
]
