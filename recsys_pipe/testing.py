"""Helpers shared by the test suite and the benchmark scripts: compose a config as the CLIs do,
train a run in this process, launch torchrun workers, read what they wrote, inject faults into a training run, train
torchrec's own pipeline as the reference of the parity tests.

(The engine's own test backend -- recording streams and the happens-before checker -- is
`recsys_pipe.engine.testing`.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recsys_pipe.runtime import DistInfo
    from recsys_pipe.train import Trainer, TrainSummary

__all__ = [
    "FAULT_ENV",
    "FAULT_OVERRIDE",
    "PRELOADED",
    "StaleEmbeddingLoop",
    "built_trainer",
    "check_torchrun",
    "compose",
    "fit_run",
    "inject_fault",
    "zero_grad_with_fault",
    "load_run",
    "read_rank_results",
    "run_stale_embedding_reference",
    "run_torchrec_pipeline",
    "torchrec_pipeline",
    "fork_ranks",
    "run_torchrun",
]

#: environment variable naming the fault `inject_fault` injects: "<kind>:<rank>:<step>"
FAULT_ENV = "RECSYS_PIPE_FAULT"
#: the override that makes any shipped plan inject that fault: its zero_grad task (the first
#: of each training step) goes through `zero_grad_with_fault`
FAULT_OVERRIDE = "pipeline.tasks.zero_grad.fn=recsys_pipe.testing:zero_grad_with_fault"


def compose(*overrides: str, config_name: str = "config") -> Any:
    """The DictConfig Hydra composes for `recsys-train` (config_name="train"/"config") or
    `recsys-plan` ("plan") with these command-line overrides (without the `hydra` node)."""
    from omegaconf import open_dict

    from recsys_pipe.cli.compose import compose_config

    cfg = compose_config(*overrides, config_name=config_name)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def load_run(*overrides: str, config_name: str = "config") -> Any:
    """The validated `RunConfig` for these overrides (raises ConfigError like the CLIs)."""
    from recsys_pipe.train.config import load_run_config

    return load_run_config(compose(*overrides, config_name=config_name))


@contextmanager
def built_trainer(
    info: DistInfo, overrides: Sequence[str], run_dir: str | os.PathLike | None = None
) -> Iterator[Trainer]:
    """The `Trainer` of the run these overrides configure, built in this process on `info`'s
    process group the way `recsys-train` builds it, and closed on exit. With a `run_dir`
    (created if missing) the run writes metrics and checkpoints there."""
    from recsys_pipe.train import Trainer, build_parts, training_plan

    run = load_run(*overrides)
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    trainer = Trainer(build_parts(run, training_plan(run), info, None if run_dir is None else str(run_dir)))
    try:
        yield trainer
    finally:
        trainer.close()


def fit_run(
    info: DistInfo,
    overrides: Sequence[str],
    run_dir: str | os.PathLike | None = None,
    restore: str | None = None,
) -> TrainSummary:
    """Train the run these overrides configure (`built_trainer`), after restoring the checkpoint
    at `restore` if given, and return its summary with every step's loss and sample ids."""
    with built_trainer(info, overrides, run_dir) as trainer:
        if restore is not None:
            trainer.restore(restore)
        return trainer.fit(record_steps=True)


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
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


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
        deadline, code = time.monotonic() + timeout, 0
        try:
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired([str(script), *args], timeout)
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


def zero_grad_with_fault(ctx: Any) -> None:
    """The `zero_grad` task, after `inject_fault` (see `FAULT_OVERRIDE`)."""
    from recsys_pipe.train.tasks import zero_grad

    inject_fault(ctx)
    zero_grad(ctx)


def inject_fault(ctx: Any) -> None:
    """Inject the fault `$RECSYS_PIPE_FAULT` names from a task, for failure tests.

    `RECSYS_PIPE_FAULT=<kind>:<rank>:<step>` fires on that rank in that training step (1-based,
    counted from the start of this process's training) of the task that calls it:
    `sigkill` (the process dies), `sigterm` (as a scheduler's preemption), `raise` (an exception
    in the task), `collective` (the rank's next collective fails), `hang` (the rank stops
    responding). Evaluation never fires it, nor a job restarted by torchrun (`--max-restarts`:
    `TORCHELASTIC_RESTART_COUNT` > 0), so a fault hits the first attempt only.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec or not ctx.state.training or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    kind, rank, step = spec.split(":")
    import torch.distributed as dist

    if dist.get_rank() != int(rank) or ctx.batch_index + 1 != int(step):
        return
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    elif kind == "collective":  # this rank's process group goes away: its next collective fails
        dist.destroy_process_group()
    elif kind == "hang":
        time.sleep(3600)
    else:
        raise ValueError(f"{FAULT_ENV}: unknown fault kind {kind!r} (sigkill, sigterm, raise, collective, hang)")


def torchrec_pipeline(model: Any, optimizer: Any, device: Any, pipeline: str, **options: Any) -> Any:
    """torchrec's own pipeline class `pipeline` (a name in
    `torchrec.distributed.train_pipeline.train_pipelines`) around `model`, constructed with
    `options`, whose `progress()` returns (loss, sample ids) of the batch it trained.

    `TrainPipelineBase` calls the model itself (no `custom_model_fwd`): it gets a wrapper module
    returning the same pair as the custom forward of the others.
    """
    import torch
    from torchrec.distributed.train_pipeline import train_pipelines

    def forward(batch: Any) -> tuple[Any, tuple[Any, Any]]:
        loss, _ = model(batch)
        return loss, (loss.detach(), batch.sample_ids)

    cls = getattr(train_pipelines, pipeline)
    if issubclass(cls, train_pipelines.TrainPipelineSparseDist):
        return cls(model, optimizer, device, custom_model_fwd=forward, **options)

    class _Forward(torch.nn.Module):  # TrainPipelineBase: model(batch) -> (losses, output)
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, batch: Any) -> tuple[Any, tuple[Any, Any]]:
            return forward(batch)

    return cls(_Forward(), optimizer, device, **options)


def run_torchrec_pipeline(
    model: Any,
    optimizer: Any,
    device: Any,
    batches: Any,
    pipeline: str = "TrainPipelineSparseDist",
    grad_accumulation: tuple[int, int] | None = None,
    **options: Any,
) -> tuple[list[float], list[list[int]]]:
    """Train every batch of `batches` with torchrec's own pipeline class (`torchrec_pipeline`),
    the reference the parity tests compare the plans with: per-step losses and trained sample ids.

    `grad_accumulation=(steps, warmup_steps)` wraps it in torchrec's `GradientAccumulationWrapper`.
    """
    from torchrec.distributed.train_pipeline import GradientAccumulationConfig, GradientAccumulationWrapper

    pipe = torchrec_pipeline(model, optimizer, device, pipeline, **options)
    if grad_accumulation is not None:
        steps, warmup = grad_accumulation
        config = GradientAccumulationConfig(num_steps=steps, num_warmup_steps=warmup)
        pipe = GradientAccumulationWrapper(pipe, optimizer, model, config)
    it, losses, ids = iter(batches), [], []
    while True:  # torchrec's pipeline ends with StopIteration once every batch is trained
        try:
            loss, sample_ids = pipe.progress(it)
        except StopIteration:
            break
        losses.append(float(loss))
        ids.append(sample_ids.tolist())
    return losses, ids


class StaleEmbeddingLoop:
    """One step per `progress(it)` of a plain training loop with semi-synchronous embeddings, the
    reference of the `semi_sync` plans where torchrec's TrainPipelineSemiSync cannot run (CPU):
    batch i's embedding lookup reads the tables as they were before batch i-1's update (one step
    stale) for i > `start_batch` (torchrec's synchronous warm-up before that; with the default 0,
    batches 0 and 1 both read the initial tables), while the dense part and the tables' own
    update are current.

    No pipelining machinery: the model's own forward (DistributedModelParallel), with each local
    table shard swapped to its previous-step copy for the forward and back to the current weights
    before backward, whose fused update then applies batch i's gradients to the current tables.
    With `stash_gradients` the dense step after batch i >= start_batch applies batch i-1's
    gradients (the first such step none). It steps through `self._optimizer`, so torchrec's
    `GradientAccumulationWrapper` can wrap it like one of torchrec's pipelines.
    """

    def __init__(self, model: Any, optimizer: Any, stash_gradients: bool = False, start_batch: int = 0) -> None:
        self._model = model
        self._optimizer = optimizer
        self._stash = stash_gradients
        self._start = start_batch
        self._tables = _local_table_weights(model)
        self._previous: list[Any] | None = None
        self._kept: dict[str, Any] = {}
        self._index = 0

    def progress(self, it: Any) -> tuple[Any, Any]:
        batch = next(it)  # StopIteration ends the run, as torchrec's pipelines
        batch = batch.to(self._tables[0].device, non_blocking=False)  # host batches, as the pipelines take them
        i, self._index = self._index, self._index + 1
        current = [w.detach().clone() for w in self._tables]
        stale = self._previous if self._previous is not None and i > self._start else current
        for weight, old in zip(self._tables, stale, strict=True):
            weight.data.copy_(old)  # .data: the lookup's saved weights keep their autograd version
        self._optimizer.zero_grad()
        loss, _ = self._model(batch)
        for weight, now in zip(self._tables, current, strict=True):
            weight.data.copy_(now)
        loss.backward()
        if self._stash and i >= self._start:
            for name, param in self._model.named_parameters():  # a copy: DDP may reuse the gradient's storage
                grad, param.grad = param.grad, self._kept.get(name)
                if grad is not None:
                    self._kept[name] = grad.clone()
        self._optimizer.step()
        self._previous = current
        return loss, batch.sample_ids


def run_stale_embedding_reference(
    model: Any,
    optimizer: Any,
    batches: Any,
    stash_gradients: bool = False,
    start_batch: int = 0,
    grad_accumulation: tuple[int, int] | None = None,
) -> tuple[list[float], list[list[int]]]:
    """Train every batch of `batches` with `StaleEmbeddingLoop` (wrapped in torchrec's
    `GradientAccumulationWrapper` with `grad_accumulation=(steps, warmup_steps)`): per-step
    losses and trained sample ids."""
    from torchrec.distributed.train_pipeline import GradientAccumulationConfig, GradientAccumulationWrapper

    loop: Any = StaleEmbeddingLoop(model, optimizer, stash_gradients, start_batch)
    if grad_accumulation is not None:
        steps, warmup = grad_accumulation
        config = GradientAccumulationConfig(num_steps=steps, num_warmup_steps=warmup)
        loop = GradientAccumulationWrapper(loop, optimizer, model, config)
    it, losses, ids = iter(batches), [], []
    while True:
        try:
            loss, sample_ids = loop.progress(it)
        except StopIteration:
            break
        losses.append(float(loss))
        ids.append(sample_ids.tolist())
    return losses, ids


def _local_table_weights(model: Any) -> list[Any]:
    """The local shards of the model's sharded tables, as views of the tables' own storage
    (writing into them changes what the lookup reads)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    weights = [
        shard.tensor
        for value in model.state_dict().values()
        if isinstance(value, ShardedTensor)
        for shard in value.local_shards()
    ]
    if not weights:
        raise ValueError("the model has no sharded tables")
    return weights
