"""Checkpoints of a training run with `torch.distributed.checkpoint` (DCP).

A checkpoint is a DCP directory `<run dir>/checkpoints/step_<N>/`: every rank writes its own
shards (the sharded embedding tables and their fused optimizer state as torchrec
`ShardedTensor`s, which DCP can reshard on load for another world size) and the replicated
state once (dense model and optimizer, LR scheduler, step and data position). What belongs to
one rank only (its RNG states) goes to `rng/rank<r>.pt` next to DCP's files: a DCP load
expects every key of the checkpoint in every rank's state dict, so per-rank keys cannot be
loaded there.

A checkpoint becomes visible only once complete: the ranks write into a hidden
`.step_<N>.partial/` directory, and rank 0 renames it to `step_<N>` after DCP has written its
metadata (which it does only after every rank's data is written). A crash mid-save leaves at
most a `.partial` directory, which is never loaded.

`resume_from` accepts a checkpoint directory, a run directory (its newest complete checkpoint),
or `latest` (the newest complete checkpoint under `trainer.output_dir`, or a fresh start when
there is none, so a requeued job can always pass it).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import Field, StrictBool, StrictInt

from recsys_pipe.config import ConfigError, ConfigProblem, Section

__all__ = [
    "CHECKPOINTS_DIR",
    "CheckpointConfig",
    "Checkpointer",
    "find_checkpoints",
    "load_checkpoint",
    "resolve_resume",
]

log = logging.getLogger(__name__)

#: checkpoints live in `<run dir>/CHECKPOINTS_DIR/step_<N>`
CHECKPOINTS_DIR = "checkpoints"
_NAME = re.compile(r"^step_(\d+)$")
#: DCP writes this file last, on the coordinator, once every rank's data is written
_METADATA = ".metadata"


class CheckpointConfig(Section):
    """When and how checkpoints are written (`trainer.checkpoint.*`)."""

    interval: StrictInt = Field(0, ge=0, description="save every N steps and at the end (0: off; SIGTERM still saves)")
    keep_latest: StrictInt = Field(3, ge=0, description="keep the K newest checkpoints of the run (0: keep all)")
    async_: StrictBool = Field(
        False, alias="async", description="save in a background thread (DCP async_save) while training goes on"
    )


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path


def find_checkpoints(run_dir: str | os.PathLike) -> list[CheckpointInfo]:
    """The complete checkpoints of a run directory, oldest step first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match and (path / _METADATA).is_file():
            found.append(CheckpointInfo(int(match.group(1)), path))
    return sorted(found, key=lambda c: c.step)


def resolve_resume(spec: str | None, output_dir: str) -> Path | None:
    """The checkpoint `trainer.resume_from` names (see the module docstring); None for a fresh
    start. ConfigError (at `trainer.resume_from`) if the path holds no complete checkpoint."""
    if spec is None:
        return None
    key = "trainer.resume_from"
    if spec == "latest":
        candidates = [c.path for run in _run_dirs(Path(output_dir)) for c in find_checkpoints(run)]
        if not candidates:
            return None
        return max(candidates, key=lambda p: (p / _METADATA).stat().st_mtime_ns)
    path = Path(spec)
    if not path.exists():
        raise ConfigError(ConfigProblem(key, f"no such checkpoint or run directory: {spec}"))
    if (path / _METADATA).is_file():
        return path
    if path.name.endswith(".partial"):
        raise ConfigError(ConfigProblem(key, f"{spec} is an incomplete checkpoint (its save did not finish)"))
    found = find_checkpoints(path)
    if not found:
        raise ConfigError(
            ConfigProblem(
                key, f"{spec} holds no complete checkpoint (expected a run directory with {CHECKPOINTS_DIR}/step_<N>/)"
            )
        )
    return found[-1].path


def _run_dirs(root: Path) -> list[Path]:
    """Directories under `root` that hold a `checkpoints/` folder (run directories)."""
    if not root.is_dir():
        return []
    return [p.parent for p in root.rglob(CHECKPOINTS_DIR) if p.is_dir()]


def load_checkpoint(
    path: str | os.PathLike,
    state: dict[str, Any],
    rank_state: Any = None,
    rank: int = 0,
    group: dist.ProcessGroup | None = None,
) -> bool:
    """Load the checkpoint at `path` into `state` in place (DCP; `Stateful` values get their
    `load_state_dict` called), and this rank's own state into `rank_state` (a `Stateful`) if the
    checkpoint has it. Returns whether it had (not when resuming on more ranks than saved)."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=str(path), process_group=group, planner=_load_planner())
    own = _rank_file(Path(path), rank)
    if rank_state is None or not own.is_file():
        return False
    rank_state.load_state_dict(torch.load(own, weights_only=True))
    return True


def _load_planner() -> Any:
    """DCP's default load planner without its fallback for checkpoints older than torch 2.4.

    torchrec's fused optimizer reports state only for tables with a shard on this rank, so a
    checkpoint legitimately holds keys a rank does not load (another rank's table state). DCP
    takes any such key as the sign of a pre-2.4 checkpoint and re-flattens the state the old
    way, which then fails; this planner plans the load directly (strict: every key this rank
    asks for must be in the checkpoint)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    class _Planner(DefaultLoadPlanner):
        def create_local_plan(self) -> Any:
            return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)

    return _Planner()


def _rank_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / "rng" / f"rank{rank}.pt"


class Checkpointer:
    """Writes a run's checkpoints: `save(step, state)` every `interval` steps, atomically visible,
    keeping the newest `keep_latest`; with `async`, the write happens in DCP's background
    thread and is made visible at a later `poll()`/`wait()`.

    Args:
        run_dir: the run directory (checkpoints go to `<run_dir>/checkpoints/`).
        cfg: `trainer.checkpoint`.
        group: the process group of DCP's collectives: a gloo group of its own, so that an
            asynchronous save never interleaves its collectives with training's.
        rank: this process's rank (rank 0 publishes and prunes).
    """

    def __init__(self, run_dir: str | os.PathLike, cfg: CheckpointConfig, group: dist.ProcessGroup | None, rank: int):
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.cfg = cfg
        self.group = group
        self.rank = rank
        self._pending: tuple[Future, CheckpointInfo, Path] | None = None
        self.last: CheckpointInfo | None = None
        #: called with each checkpoint once it is visible (rank 0): e.g. to log it
        self.on_published: Callable[[CheckpointInfo], None] | None = None

    def due(self, step: int) -> bool:
        return self.cfg.interval > 0 and step % self.cfg.interval == 0

    def save(self, step: int, state: dict[str, Any], rank_state: Any = None, blocking: bool = False) -> None:
        """Save `state` (DCP) and this rank's `rank_state` (a `Stateful`) as `step_<step>`;
        asynchronous when configured and not `blocking`."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        self.wait()  # one save at a time
        final = self.root / f"step_{step}"
        partial = self.root / f".step_{step}.partial"
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash of an earlier attempt
            partial.mkdir(parents=True)
        if dist.is_initialized():
            dist.barrier(group=self.group)
        if rank_state is not None:  # before DCP's collectives: written once rank 0 publishes
            own = _rank_file(partial, self.rank)
            own.parent.mkdir(exist_ok=True)
            torch.save(rank_state.state_dict(), own)
        writer = FileSystemWriter(str(partial))
        info = CheckpointInfo(step, final)
        if self.cfg.async_ and not blocking:
            # FileSystemWriter stages a copy of the state on the CPU before returning, so
            # training may change the live tensors while the copy is written
            future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
            self._pending = (future, info, partial)
            return
        dcp.save(state, storage_writer=writer, process_group=self.group)
        self._publish(info, partial)

    def poll(self) -> None:
        """Publish a finished asynchronous save (cheap; call at step boundaries)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until a pending asynchronous save is written, then publish it."""
        if self._pending is None:
            return
        future, info, partial = self._pending
        self._pending = None
        future.result()  # re-raises a failed save
        self._publish(info, partial)

    def _publish(self, info: CheckpointInfo, partial: Path) -> None:
        self.last = info
        if self.rank != 0:
            return
        if info.path.exists():  # the same step saved again (e.g. a rerun into this run dir)
            shutil.rmtree(info.path)
        os.replace(partial, info.path)
        if self.on_published is not None:
            self.on_published(info)
        if self.cfg.keep_latest:
            for old in find_checkpoints(self.root.parent)[: -self.cfg.keep_latest]:
                shutil.rmtree(old.path, ignore_errors=True)
