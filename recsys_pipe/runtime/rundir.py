"""Run directories: one new directory per job, shared by the ranks of that job, never by two jobs.

`<trainer.output_dir>/recsys-train/<time>/` by default; a directory the user names
(`hydra.run.dir`, or a sweep job's `hydra.sweep.dir/<n>`) is used as it is, but only if no run
has used it before: rank 0 claims it by creating its `status.json` exclusively.
"""

from __future__ import annotations

import datetime
import os
import tempfile

import torch.distributed as dist

from recsys_pipe.config import ConfigError, ConfigProblem

__all__ = ["check_output_dir", "check_unused", "claim_dir", "shared_run_dir", "unique_dir"]

#: the file whose existence marks a directory as a run's (see `recsys_pipe.runtime.status`)
STATUS_FILE = "status.json"


def unique_dir(base: str | os.PathLike, name: str) -> str:
    """Create `<base>/<name>`, or `<name>-2`, `<name>-3`, ... if taken, and return it.

    `os.mkdir` either creates a directory or fails, atomically, so two runs started in the same
    second (two shells, or two jobs of a sweep) never end up in one directory."""
    os.makedirs(base, exist_ok=True)
    for n in range(1, 10_000):
        path = os.path.join(base, name if n == 1 else f"{name}-{n}")
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"no free run directory name under {base}")


def check_output_dir(path: str, key: str = "trainer.output_dir") -> None:
    """Make sure run directories can be created under `path` (creating it if needed); a
    ConfigError at `key` naming the reason otherwise."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path, prefix=".recsys_probe_"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(ConfigProblem(key, f"cannot create run directories under {path}: {reason}")) from None


def check_unused(path: str, key: str) -> None:
    """ConfigError at `key` if `path` already holds a run (its `status.json`)."""
    status = os.path.join(path, STATUS_FILE)
    if os.path.exists(status):
        raise ConfigError(
            ConfigProblem(key, f"{path} already holds a run ({status} exists); choose a new directory or remove it")
        )


def claim_dir(path: str, key: str) -> None:
    """Rank 0's atomic claim of a named run directory: creates its `status.json` exclusively."""
    check_output_dir(path, key)
    try:
        os.close(os.open(os.path.join(path, STATUS_FILE), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        check_unused(path, key)
        raise


def shared_run_dir(base: str, name: str, requested: str | None = None, key: str = "") -> str:
    """The run directory of this job, the same on every rank.

    Rank 0 creates a new one, `<base>/<name>/<time>` (unique, see `unique_dir`), or claims
    `requested` (`claim_dir`), and broadcasts the outcome.

    Args:
        base: `trainer.output_dir`.
        name: the program's name (`recsys-train`, ...).
        requested: an explicit run directory (`hydra.run.dir`), or None for a new one.
        key: the config path of `requested`, for the error.

    Returns:
        The run directory's path. Raises ConfigError at `key` if `requested` was
        used before."""
    outcome: list = [None]
    if dist.get_rank() == 0:
        try:
            if requested is None:
                stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
                outcome[0] = unique_dir(os.path.join(base, name), stamp)
            else:
                claim_dir(requested, key)
                outcome[0] = requested
        except ConfigError as exc:
            outcome[0] = exc
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], ConfigError):
        raise outcome[0]
    return outcome[0]
