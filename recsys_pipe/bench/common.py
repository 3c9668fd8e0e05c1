"""What the benchmarks share: the median (min-max) summary they report, the re-launch of a
multi-rank benchmark under torchrun when it was started as a plain module, one intra-op thread per
rank, and the teardown of a multi-rank benchmark's process.

Standard library only at import (torch loads inside the functions that need it): the engine and
GPU benchmarks run on machines that have torch and nothing else of the training stack.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["format_summary", "one_thread_per_rank", "reexec_under_torchrun", "run_ranks", "summary", "train_speed"]


def summary(values: Iterable[float], digits: int = 3) -> dict[str, float]:
    """Median, min and max of `values`, rounded to `digits`.

    Returns:
        ``{"median": ..., "min": ..., "max": ...}``.
    """
    values = list(values)
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def format_summary(s: dict[str, float], unit: str = "") -> str:
    """A `summary` as text: `median<unit> (min–max)`."""
    return f"{s['median']}{unit} ({s['min']}–{s['max']})"


def reexec_under_torchrun(module: str, nproc: int) -> None:
    """Replace this process by `torchrun --standalone --nproc_per_node nproc -m module args...`
    (one intra-op thread per rank), unless it already is a torchrun worker.

    Args:
        module: the benchmark's module name (`recsys_pipe.bench.train`), run by every rank with
            `-m`, so each rank imports the same package as this process.
        nproc: ranks to start.
    """
    if "LOCAL_RANK" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    command = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    os.execv(sys.executable, [sys.executable, *command, "-m", module, *sys.argv[1:]])


def one_thread_per_rank() -> None:
    """One intra-op thread in this process: ranks share the machine's cores, and a second
    OpenMP thread per rank only contends with the other rank. Called before the first torch
    operation, which is when torch sizes its thread pool."""
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def run_ranks(main: Callable[[], object]) -> None:
    """Run a multi-rank benchmark's `main` on this rank, then end the process with its exit code.

    Every rank meets a barrier after `main` returns, so none tears the process group down under
    another. `SystemExit` keeps its code (`--help` 0, argparse errors 2, `SystemExit(1)` a failed
    check; a message, as from `SystemExit("error: ...")`, is printed and exits 2); any other
    exception prints its traceback and exits 1. The process then ends with `os._exit`, after
    flushing stdout and stderr: the interpreter's own shutdown, with its gloo teardown, is
    skipped. Never returns.
    """
    import torch.distributed as dist

    code = 0
    try:
        main()
        if dist.is_initialized():
            dist.barrier()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (2 if exc.code else 0)
        if not isinstance(exc.code, int) and exc.code:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def sequences_train_speed(data: str, steps: int, info: Any, *overrides: str) -> tuple[float, float]:
    """`train_speed` of a `data=sequences` run on the file `data` as the reference benchmarks
    train it (the serial plan on the CPU, `steps` steps, no evaluation, one log line), with the
    model's `overrides` after those."""
    from recsys_pipe.testing import load_run

    run = load_run(
        "data=sequences",
        f"data.path={data}",
        "pipeline=serial",
        "model.sharding=row_wise",
        "trainer.device=cpu",
        f"trainer.max_steps={steps}",
        "trainer.eval_every=0",
        "trainer.progress_bar=false",
        f"trainer.log_every={steps}",
        *overrides,
    )
    return train_speed(run, info)


def train_speed(run: Any, info: Any) -> tuple[float, float]:
    """Samples/s of recsys_pipe's trainer fitting `run` (a validated RunConfig) on `info`'s
    process group, by the wall clock and by this process's CPU clock (the reference
    benchmarks compare both)."""
    from recsys_pipe.train import Trainer, build_parts, training_plan

    trainer = Trainer(build_parts(run, training_plan(run), info))
    try:
        cpu = time.process_time()
        summary_ = trainer.fit()
        return summary_.samples_per_s, summary_.samples / (time.process_time() - cpu)
    finally:
        trainer.close()
