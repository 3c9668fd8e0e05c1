"""Which experiment a checkpoint belongs to: the fingerprint saved with every checkpoint.

`trainer.resume_from=latest` takes the newest checkpoint under `trainer.output_dir` of *this*
experiment: the same model, the same data and the same global batch (the rows of a batch over
all data-parallel replicas: what splits an epoch into steps; how many batches an optimizer step
accumulates, the optimizer and the plan are settings a resume may change, and it says so).
Another run in the same directory (another model, another data set, another
global batch) is skipped, and named in the log. Each checkpoint carries `fingerprint.json`: the
model and data sections as validated (data paths made absolute; the keys that do not change what
is trained left out: the per-rank batch size, which the global batch replaces, the DataLoader
workers and pinning; `model.table_init`, which decides only the initial weights a resume replaces)
and the global batch. A checkpoint written before fingerprints were saved
is fingerprinted from its run's `config.yaml` and the ranks that wrote it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.train.checkpoint import (
    RESUME_KEY,
    check_checkpoint,
    newest_checkpoints,
    read_metadata,
    resolve_resume,
    saved_config,
    saved_world_size,
)

__all__ = ["FINGERPRINT_FILE", "ResumeChoice", "RunFingerprint", "choose_resume", "fingerprint", "saved_fingerprint"]

FINGERPRINT_FILE = "fingerprint.json"
#: data keys that change how rows are read, not which rows are trained
_INCIDENTAL_DATA_KEYS = ("batch_size", "num_workers", "pin_memory", "eval_batch_size")
_PATH_KEYS = ("path", "eval_path")
#: model keys that decide only the initial weights, which a resume replaces with the checkpoint's
_INITIAL_ONLY_MODEL_KEYS = ("table_init",)


@dataclass(frozen=True)
class RunFingerprint:
    """The model and data sections (as JSON values) and the global batch of an experiment."""

    model: dict[str, Any]
    data: dict[str, Any]
    global_batch: int

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "data": self.data, "global_batch": self.global_batch}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunFingerprint:
        values = json.loads(text)
        return cls(values["model"], values["data"], int(values["global_batch"]))

    def difference(self, other: RunFingerprint) -> str | None:
        """The first thing `other` (a checkpoint's) trains differently, in words; None if the same."""
        for section, mine, theirs in (("model", self.model, other.model), ("data", self.data, other.data)):
            for key in sorted(set(mine) | set(theirs)):
                if mine.get(key) != theirs.get(key):
                    return f"{section}.{key} is {_short(theirs.get(key))} there, {_short(mine.get(key))} here"
        if self.global_batch != other.global_batch:
            return f"a global batch of {other.global_batch} rows there, {self.global_batch} here"
        return None


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _absolute(value: Any) -> Any:
    if isinstance(value, list):
        return [_absolute(v) for v in value]
    if isinstance(value, str) and "://" not in value:
        return os.path.abspath(os.path.expanduser(value))
    return value


def fingerprint(run: Any, world_size: int) -> RunFingerprint:
    """The fingerprint of `run` (a `RunConfig`) trained on `world_size` ranks."""
    from recsys_pipe.train.parallel import parallelism_of

    model = run.model.model_dump(mode="json", by_alias=True)
    data = run.data.model_dump(mode="json", by_alias=True)
    for key in _INITIAL_ONLY_MODEL_KEYS:
        model.pop(key, None)
    for key in _INCIDENTAL_DATA_KEYS:
        data.pop(key, None)
    for key in _PATH_KEYS:
        if data.get(key) is not None:
            data[key] = _absolute(data[key])
    replicas = parallelism_of(run).replicas(world_size)
    return RunFingerprint(model, data, run.data.batch_size * replicas)


def saved_fingerprint(checkpoint: Path, world_size: int | None = None) -> RunFingerprint | None:
    """The fingerprint of the checkpoint at `checkpoint`: its `fingerprint.json`, else made from
    its run's `config.yaml` on `world_size` ranks (the ranks that wrote it); None if neither
    can be read."""
    from recsys_pipe.train.config import load_run_config

    try:
        return RunFingerprint.from_json((checkpoint / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError, KeyError):
        pass
    saved = saved_config(checkpoint)
    if saved is None or world_size is None:
        return None
    try:
        return fingerprint(load_run_config(saved), world_size)
    except (ConfigError, ValueError, TypeError):
        return None


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint a run resumes from (None: a fresh start), and the newer checkpoints of
    other experiments `latest` passed over, each with what differs."""

    path: Path | None
    skipped: tuple[tuple[Path, str], ...] = ()


def choose_resume(
    spec: str | None,
    output_dir: str,
    model_name: str | None = None,
    mine: RunFingerprint | None = None,
    tables: Callable[[], Mapping[str, tuple[int, int]] | None] | None = None,
) -> ResumeChoice:
    """`resolve_resume`, where `latest` takes the newest checkpoint of the experiment `mine`
    names, passing over those of others (ConfigError naming the newest of them when there is no
    other)."""
    if spec != "latest" or mine is None:
        return ResumeChoice(resolve_resume(spec, output_dir, model_name, tables))
    skipped: list[tuple[Path, str]] = []
    for path in newest_checkpoints(output_dir):
        saved = saved_fingerprint(path, saved_world_size(read_metadata(path)))
        difference = "its fingerprint cannot be read" if saved is None else mine.difference(saved)
        if difference is None:
            check_checkpoint(path, model_name, tables() if tables is not None else None)
            return ResumeChoice(path, tuple(skipped))
        skipped.append((path, difference))
    if skipped:
        newest, why = skipped[0]
        where = os.path.expanduser(output_dir)
        raise ConfigError(
            ConfigProblem(
                RESUME_KEY,
                f"latest: no checkpoint under {where} is of this experiment; the newest, {newest}, is of "
                f"another ({why}); to continue from it anyway set trainer.resume_from={newest}",
            )
        )
    return ResumeChoice(None)
