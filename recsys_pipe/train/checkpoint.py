"""Checkpoints of a training run with `torch.distributed.checkpoint` (DCP).

A checkpoint is a DCP directory `<run dir>/checkpoints/step_<N>/`: every rank writes its own
shards (the sharded embedding tables and their fused optimizer state as torchrec
`ShardedTensor`s, which DCP can reshard on load for another world size) and the replicated
state once (dense model and optimizer, LR scheduler, step and data position). What belongs to
one rank only (its RNG states; a semi-synchronous plan's lookups and gradients in flight) goes
to `rng/rank<r>.pt` next to DCP's files: a DCP load expects every key of the checkpoint in
every rank's state dict, so per-rank keys cannot be loaded there.

A checkpoint becomes visible only once complete: the ranks write into a hidden
`.step_<N>.partial/` directory, and rank 0 renames it to `step_<N>` after DCP has written its
metadata (which it does only after every rank's data is written). A crash mid-save leaves at
most a `.partial` directory, which is never loaded.

`resume_from` accepts a checkpoint directory, a run directory (its newest complete checkpoint),
or `latest`: the newest complete checkpoint under `trainer.output_dir` of the same experiment
(`recsys_pipe.train.fingerprint`: model, data, global batch; newer ones of other experiments
are passed over and logged), or a fresh start when there is none at all, so a requeued job can
always pass it; when there are only other experiments' checkpoints the run is refused, naming
the newest and how to force it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import Field, StrictBool, StrictInt

from recsys_pipe import _ctrl_c
from recsys_pipe.config import ConfigError, ConfigProblem, Section
from recsys_pipe.train.checkpoint_errors import writing_checkpoint

__all__ = [
    "CHECKPOINTS_DIR",
    "CheckpointConfig",
    "Checkpointer",
    "check_checkpoint",
    "compare_state",
    "find_checkpoints",
    "load_checkpoint",
    "newest_checkpoints",
    "read_metadata",
    "resolve_resume",
    "saved_config",
    "saved_model_name",
    "saved_world_size",
]

log = logging.getLogger(__name__)

#: checkpoints live in `<run dir>/CHECKPOINTS_DIR/step_<N>`
CHECKPOINTS_DIR = "checkpoints"
_NAME = re.compile(r"^step_(\d+)$")
#: DCP writes this file last, on the coordinator, once every rank's data is written
_METADATA = ".metadata"
#: the config key every checkpoint problem is reported at
RESUME_KEY = "trainer.resume_from"


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


def resolve_resume(
    spec: str | None,
    output_dir: str,
    model_name: str | None = None,
    tables: Callable[[], Mapping[str, tuple[int, int]] | None] | None = None,
) -> Path | None:
    """The checkpoint `trainer.resume_from` names (see the module docstring; `latest` here: the
    newest of any experiment, `recsys_pipe.train.fingerprint.choose_resume` takes this run's);
    None for a fresh start. ConfigError (at `trainer.resume_from`) if the path holds no complete
    checkpoint, or one that cannot fit (`check_checkpoint`; `model_name`: the model this run
    trains; `tables`: gives its torchrec tables' shapes by name, asked only when there is a
    checkpoint)."""
    if spec == "latest":
        newest = newest_checkpoints(output_dir)
        path = newest[0] if newest else None
    else:
        path = _resolve(spec)
    if path is not None:
        check_checkpoint(path, model_name, tables() if tables is not None else None)
    return path


def newest_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Every complete checkpoint of every run under `output_dir`, the newest written first."""
    candidates = [c.path for run in _run_dirs(Path(os.path.expanduser(str(output_dir)))) for c in find_checkpoints(run)]
    return sorted(candidates, key=lambda p: (p / _METADATA).stat().st_mtime_ns, reverse=True)


def _resolve(spec: str | None) -> Path | None:
    if spec is None:
        return None
    key = RESUME_KEY
    path = Path(os.path.expanduser(spec))
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


def check_checkpoint(
    path: Path, model_name: str | None = None, tables: Mapping[str, tuple[int, int]] | None = None
) -> None:
    """What can be checked of a checkpoint from its own files, before DCP reads any tensor:
    its metadata reads, every data file it names is there and long enough, (when the run
    directory's `config.yaml` says which model wrote it) the model is `model_name`, and every
    table of `tables` (name -> (rows, dim), the config's) has that shape in it.
    ConfigError at `trainer.resume_from` naming what differs (the first table that differs)."""
    metadata = read_metadata(path)
    sizes: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = int(info.offset) + int(info.length)
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end)
    for name, needed in sorted(sizes.items()):
        file = path / name
        if not file.is_file():
            raise _mismatch(path, f"its data file {name} is missing")
        have = file.stat().st_size
        if have < needed:
            raise _mismatch(path, f"its data file {name} is truncated ({have} of {needed} bytes)")
    saved = saved_model_name(path)
    if model_name is not None and saved is not None and saved != model_name:
        raise _mismatch(path, f"it holds model '{saved}' (its run's config.yaml), this run trains '{model_name}'")
    if tables:
        _check_tables(path, metadata, tables)


def _check_tables(path: Path, metadata: Any, tables: Mapping[str, tuple[int, int]]) -> None:
    """ConfigError naming the first of `tables` whose weight the checkpoint holds in another
    shape (a table is found by its name, `...<name>.weight` under the model; DCP's metadata
    keeps each table's global size whatever its sharding)."""
    stored: dict[str, tuple[int, ...]] = {}
    for key, item in metadata.state_dict_metadata.items():
        parts = key.split(".")
        if key.startswith("train.model.") and parts[-1] == "weight" and getattr(item, "size", None) is not None:
            stored.setdefault(parts[-2], tuple(item.size))
    for name, shape in tables.items():
        have = stored.get(name)
        if have is not None and have != tuple(shape):
            raise _mismatch(
                path,
                f"table {name} is {list(have)} (rows, dim) in the checkpoint and {list(shape)} in this config: "
                "its rows come from the data (e.g. data.num_embeddings) and its width from model.embedding_dim; "
                "resume with the checkpoint's sizes",
            )


def read_metadata(path: Path) -> Any:
    """DCP's metadata of the checkpoint at `path` (ConfigError if unreadable)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a truncated or foreign .metadata fails to unpickle in many ways
        raise _mismatch(path, f"its {_METADATA} cannot be read ({type(exc).__name__}: {_first_line(exc)})") from None


def saved_config(path: Path) -> dict[str, Any] | None:
    """The config.yaml of the run that wrote the checkpoint at `path` (None if absent)."""
    import yaml

    config = Path(path).parent.parent / "config.yaml"
    try:
        data = yaml.safe_load(config.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def saved_model_name(path: Path) -> str | None:
    """`model.name` in the config.yaml of the run that wrote the checkpoint (None if absent)."""
    data = saved_config(path)
    model = data.get("model") if data is not None else None
    name = model.get("name") if isinstance(model, dict) else None
    return str(name) if name is not None else None


def saved_world_size(metadata: Any) -> int:
    """Ranks that wrote the checkpoint: DCP's data files are named `__<rank>_<n>.distcp`."""
    ranks = {m.group(1) for i in metadata.storage_data.values() if (m := re.match(r"__(\d+)_", i.relative_path))}
    return max(len(ranks), 1)


def _mismatch(path: Path, message: str) -> ConfigError:
    return ConfigError(ConfigProblem(RESUME_KEY, f"checkpoint {path} does not fit this run: {message}"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else ""


def compare_state(state: dict[str, Any], metadata: Any, path: Path, world_size: int) -> None:
    """ConfigError naming the first differences between the flattened state this run will load
    (`state`: DCP key -> tensor or value) and what the checkpoint holds: keys (parameters,
    tables, optimizer state) it lacks, and tensors of another shape."""
    saved = metadata.state_dict_metadata
    missing = [k for k in state if k not in saved]
    shapes = []
    for key, value in state.items():
        size = _global_size(value)
        stored = getattr(saved.get(key), "size", None)
        if size is not None and stored is not None and tuple(stored) != tuple(size):
            shapes.append(f"{_name(key)} is {list(stored)} in the checkpoint, {list(size)} here")
    if not missing and not shapes:
        return
    parts = shapes[:2]
    if missing:
        parts.append(f"it has no {', '.join(_name(k) for k in missing[:2])}")
    more = len(shapes) + len(missing) - min(len(shapes), 2) - min(len(missing), 2)
    text = "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
    others = [_name(k) for k in saved if k not in state]
    if missing and others:
        text += f"; it holds {', '.join(others[:2])}" + (f" and {len(others) - 2} more" if len(others) > 2 else "")
    saved_ranks = saved_world_size(metadata)
    if saved_ranks != world_size:
        text += f"; written by {saved_ranks} rank(s), loading on {world_size}"
    if any(_column_shard_state(key, saved.get(key), state[key]) for key in state if key in saved):
        text += (
            " (fbgemm's row-wise state of a column-sharded table keeps one value per row of each column shard: "
            "resume with as many column shards, or train with optimizer.sparse.name=adagrad, whose state reshards)"
        )
    raise _mismatch(path, text)


def _column_shard_state(key: str, stored: Any, value: Any) -> bool:
    """Whether `key` is fbgemm's row-wise optimizer state (`momentum1`, one dimension) of a table
    sharded into another number of column shards than the checkpoint's."""
    size, have = _global_size(value), getattr(stored, "size", None)
    if not key.endswith("momentum1") or size is None or have is None or len(size) != 1 or len(have) != 1:
        return False
    low, high = sorted((size[0], have[0]))
    return low > 0 and low != high and high % low == 0


def _global_size(value: Any) -> Any:
    """The global shape of a tensor (a ShardedTensor's or DTensor's whole table), else None."""
    if isinstance(value, torch.Tensor) or hasattr(value, "metadata"):
        size = value.size()
        return tuple(size) if size is not None else None
    return None


def _name(key: str) -> str:
    """A DCP key without the `train.` root of the checkpoint state: `model.ec.embeddings...`."""
    return key.split(".", 1)[1] if key.startswith("train.") else key


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
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    check_checkpoint(path)
    world_size = dist.get_world_size(group) if dist.is_initialized() else 1
    try:
        dcp.load(state, checkpoint_id=str(path), process_group=group, planner=_load_planner(path, world_size))
    except CheckpointException as exc:  # a failure on any rank; ours says what does not fit
        for failure in exc.failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, ConfigError):
                raise cause from None
        raise _mismatch(path, f"loading failed ({_first_line(exc)})") from exc
    own = _rank_file(Path(path), rank)
    if rank_state is None or not own.is_file():
        return False
    rank_state.load_state_dict(torch.load(own, weights_only=True))
    return True


def _load_planner(path: Path, world_size: int) -> Any:
    """DCP's default load planner without its fallback for checkpoints older than torch 2.4,
    which first compares the state to load with the checkpoint (`compare_state`).

    torchrec's fused optimizer reports state only for tables with a shard on this rank, so a
    checkpoint legitimately holds keys a rank does not load (another rank's table state). DCP
    takes any such key as the sign of a pre-2.4 checkpoint and re-flattens the state the old
    way, which then fails; this planner plans the load directly (strict: every key this rank
    asks for must be in the checkpoint)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    class _Planner(DefaultLoadPlanner):
        def create_local_plan(self) -> Any:
            # before any tensor is read: what this rank asks for against the checkpoint's metadata
            compare_state(self.state_dict, self.metadata, path, world_size)
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
        #: small files rank 0 writes into every checkpoint (name -> text), e.g. its fingerprint
        self.files: dict[str, str] = {}
        #: called with each checkpoint once it is visible (rank 0): e.g. to log it
        self.on_published: Callable[[CheckpointInfo], None] | None = None

    def due(self, step: int) -> bool:
        """Whether `trainer.checkpoint.interval` asks for a checkpoint after `step`."""
        return self.cfg.interval > 0 and step % self.cfg.interval == 0

    def save(self, step: int, state: dict[str, Any], rank_state: Any = None, blocking: bool = False) -> None:
        """Save `state` (DCP) and this rank's `rank_state` (a `Stateful`) as `step_<step>`;
        asynchronous when configured and not `blocking`."""
        import torch.distributed.checkpoint as dcp

        from recsys_pipe.train.checkpoint_writer import OSErrorKeepingWriter

        self.wait()  # one save at a time
        final = self.root / f"step_{step}"
        partial = self.root / f".step_{step}.partial"
        # a full disk or an unwritable directory: one error naming it, the partial save removed
        with writing_checkpoint(final, partial, remove=self.rank == 0):
            if self.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)  # left by a crash of an earlier attempt
                partial.mkdir(parents=True)
                for name, text in self.files.items():
                    (partial / name).write_text(text)
            _ctrl_c.pause_point("checkpoint")
            if dist.is_initialized():
                dist.barrier(group=self.group)
            if rank_state is not None:  # before DCP's collectives: written once rank 0 publishes
                own = _rank_file(partial, self.rank)
                own.parent.mkdir(exist_ok=True)
                torch.save(rank_state.state_dict(), own)
            writer = OSErrorKeepingWriter(str(partial))  # a rank's OS error reaches every rank
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
        with writing_checkpoint(info.path, partial, remove=self.rank == 0):
            future.result()  # re-raises a failed save
            self._publish(info, partial)

    def _publish(self, info: CheckpointInfo, partial: Path) -> None:
        if self.rank != 0:
            self.last = info
            return
        if info.path.exists():  # the same step saved again (e.g. a rerun into this run dir)
            shutil.rmtree(info.path)
        os.replace(partial, info.path)
        self.last = info  # once it is there: what an interrupted run's status.json names
        if self.on_published is not None:
            self.on_published(info)
        if self.cfg.keep_latest:
            for old in find_checkpoints(self.root.parent)[: -self.cfg.keep_latest]:
                shutil.rmtree(old.path, ignore_errors=True)
