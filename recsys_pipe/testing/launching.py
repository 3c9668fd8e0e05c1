"""Launching workers on several ranks for tests and benchmarks: torchrun (`run_torchrun`), or ranks
forked from a server that imported torch, torchrec and this package once (`fork_ranks`), the
environment a worker process gets (`worker_env`), how a worker rank ends (`end_rank`), and
reading what the ranks wrote (`read_rank_results`, `check_torchrun`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "PRELOADED",
    "check_torchrun",
    "end_rank",
    "fork_ranks",
    "read_rank_results",
    "run_torchrun",
    "worker_env",
]


def run_torchrun(
    script: str | os.PathLike, *args: str, nproc: int = 2, timeout: float = 500, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc_per_node N script args...` with one
    intra-op thread per rank; output captured, bounded by `timeout` (raises TimeoutExpired)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return subprocess.run(
        [*command, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=worker_env(**(env or {})),
    )


def worker_env(pythonpath: str | os.PathLike | None = None, **variables: str) -> dict[str, str]:
    """The environment of a worker process: this process's, with one intra-op thread (the ranks
    share the machine's cores), `pythonpath` put first on PYTHONPATH if given, and `variables` on
    top."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), os.environ.get("PYTHONPATH")]))
    return {**env, **variables}


def end_rank(path: str | os.PathLike, result: Any) -> NoReturn:
    """How a worker rank ends: `result` written to `path` (`torch.save` for a `.pt` file, else
    JSON), every rank waits for the others, the process group is left, the output flushed, and
    the process exits 0 at once (`os._exit`: gloo's worker threads can abort an orderly
    interpreter shutdown, about one run in ten)."""
    import torch
    import torch.distributed as dist

    if Path(path).suffix == ".pt":
        torch.save(result, path)
    else:  # json.dumps uses the C encoder, json.dump the pure-Python one
        Path(path).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


#: what a training rank imports: the fork server of `fork_ranks` imports them once
PRELOADED = ["torchrec.distributed", "torchmetrics", "recsys_pipe.cli.train", "recsys_pipe.train.build"]


def fork_ranks(
    script: str | os.PathLike,
    *args: str,
    nproc: int = 2,
    timeout: float = 500,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess:
    """`script args...` as `nproc` ranks in torchrun's environment, each forked from a server
    process that has imported torch, torchrec and this package once; the same result as
    `run_torchrun` (output captured, `TimeoutExpired` after `timeout`).

    For the tests whose subject is what the ranks compute, not the launcher: a torchrun launch
    spends about 10 CPU-seconds importing torch, torchrec and this package again in an agent and
    in every rank. Built on multiprocessing's fork server (a clean process, started once, which
    imports `PRELOADED` and forks each rank; forking the caller instead would copy its state,
    e.g. a test runner's threads or compile workers, and can hang) and torch's
    `torch.multiprocessing.start_processes` (a failed rank ends the others, as torchrun does).
    This process hosts the group's store, as torchrun's agent does (`TORCHELASTIC_USE_AGENT_STORE`),
    so no rank races another for a port. A rank gets this process's environment with `env` on
    top, in `cwd` (default: this process's working directory). The tests that are about torchrun
    itself (restarts, signals, failures) keep `run_torchrun`.

    Args:
        script: a Python file run as `__main__` by every rank (a worker, or a console script
            such as `.venv/bin/recsys-train`), with `args` as its command line.
        nproc: ranks (1 is a one-rank group with torchrun's variables, not a plain process).
        timeout: seconds before every rank is killed and `subprocess.TimeoutExpired` raised.
        env: variables set for the ranks on top of this process's environment.
        cwd: the ranks' working directory.

    Returns:
        The ranks' output (rank 0's first) and the first failed rank's exit code, 0 if none
        failed."""
    import multiprocessing
    import tempfile

    import torch.distributed as dist
    import torch.multiprocessing as mp

    # takes effect when the server starts; "__main__" (guarded, as multiprocessing requires: a
    # test runner's) imported there too, or every rank would import it again
    multiprocessing.set_forkserver_preload(["__main__", *PRELOADED])
    store = dist.TCPStore("127.0.0.1", 0, nproc, True, wait_for_workers=False)
    variables = {
        **os.environ,
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    with tempfile.TemporaryDirectory(prefix="fork_ranks_") as logs:
        context = mp.start_processes(
            _rank_main,
            (str(Path(script).resolve()), args, variables, str(cwd or os.getcwd()), logs),
            nprocs=nproc,
            join=False,
            start_method="forkserver",
        )
        try:
            code = _join_ranks(context, timeout, [str(script), *args], logs)
        finally:
            del store
        outputs = [
            "".join(
                Path(logs, f"{kind}{r}").read_text(errors="replace")
                for r in range(nproc)
                if Path(logs, f"{kind}{r}").exists()
            )
            for kind in ("stdout", "stderr")
        ]
    return subprocess.CompletedProcess([str(script), *args], code, *outputs)


def _join_ranks(context: Any, timeout: float, command: list[str], logs: str) -> int:
    """Wait for the ranks of `context` (torch's `ProcessContext`): the first failed rank's exit
    code (1 for a rank that raised: its traceback goes to its stderr log), 0 if none failed;
    `TimeoutExpired` after `timeout`. Every rank is ended and joined before it returns."""
    import torch.multiprocessing as mp

    deadline, code = time.monotonic() + timeout, 0
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(command, timeout)
    except mp.ProcessExitedException as failed:
        code = failed.exit_code
    except mp.ProcessRaisedException as failed:  # the rank's traceback, as its stderr would show
        code = 1
        with Path(logs, f"stderr{failed.error_index}").open("a") as stderr:
            stderr.write(str(failed))
    finally:
        for process in context.processes:  # the others, once one failed or time ran out
            if process.is_alive():
                process.kill()
            process.join()
    return code


def _rank_main(rank: int, script: str, args: tuple[str, ...], variables: dict[str, str], cwd: str, logs: str) -> None:
    """One rank of `fork_ranks`, as `python script args...` would start it: its output to the log
    directory, the caller's environment with torchrun's variables, the caller's working
    directory, the script run as `__main__`; a script's `sys.exit(code)` is the rank's exit
    code. The import path is the fork server's: a script loads a module beside it by its file
    (`importlib.util.spec_from_file_location`), not by putting its folder on `sys.path`."""
    import runpy

    for fd, kind in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(Path(logs, f"{kind}{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the rank's own stdout)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(variables, RANK=str(rank), LOCAL_RANK=str(rank))
    os.chdir(cwd)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    sys.stdout.flush()
    sys.stderr.flush()


def read_rank_results(directory: str | os.PathLike, nproc: int = 2) -> list[Any]:
    """The `rank<r>.json` files a torchrun worker wrote, in rank order."""
    return [json.loads(Path(directory, f"rank{r}.json").read_text()) for r in range(nproc)]


def check_torchrun(proc: subprocess.CompletedProcess, tail: int = 4000) -> None:
    """Assert a launch (`run_torchrun`, `fork_ranks`) succeeded, showing the end of its output if not."""
    assert proc.returncode == 0, proc.stdout[-tail:] + proc.stderr[-tail:]
