"""Config helpers for tests and benchmarks: compose a config as the CLIs do (`compose`), validate
it (`load_run`), build or train its run in this process (`built_trainer`, `fit_run`; stopped at
a checkpoint and resumed: `fit_resumed`), the overrides the parity workers train with
(`parity_overrides`) and of a DLRM run on Criteo-layout Parquet (`parquet_criteo_overrides`),
and `recsys-plan` run in this process (`recsys_plan`)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recsys_pipe.runtime import DistInfo
    from recsys_pipe.train import Trainer, TrainSummary

__all__ = [
    "built_trainer",
    "compose",
    "fit_resumed",
    "fit_run",
    "load_run",
    "parity_overrides",
    "parquet_criteo_overrides",
    "recsys_plan",
    "train_here",
]


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


def fit_resumed(
    info: DistInfo, overrides: Sequence[str], step: int, run_dir: str | os.PathLike
) -> tuple[TrainSummary, TrainSummary]:
    """The run these overrides configure trained to `step` with a checkpoint there (in
    `run_dir`), then trained on from that checkpoint: both summaries (`fit_run`)."""
    from recsys_pipe.train import resolve_resume

    stop = [f"trainer.max_steps={step}", f"trainer.checkpoint.interval={step}"]
    first = fit_run(info, [*overrides, *stop], run_dir=run_dir)
    return first, fit_run(info, overrides, restore=str(resolve_resume(run_dir, "unused")))


def parquet_criteo_overrides(path: str, max_steps: int) -> list[str]:
    """DLRM on the Criteo-layout Parquet at `path`, 64 rows a batch shuffled in windows of
    three, two epochs (at most `max_steps`), no logging, evaluation or TensorBoard."""
    return [
        "trainer=smoke",
        f"trainer.max_steps={max_steps}",
        "trainer.epochs=2",
        "trainer.log_every=100",
        "trainer.eval_every=0",
        "trainer.eval_batches=1",
        "trainer.tensorboard=false",
        "model=dlrm",
        "data=parquet",
        f"data.path={path}",
        "data.num_embeddings=64",
        "data.batch_size=64",
        "data.shuffle=true",
        "data.shuffle_window=192",
    ]


def raw_id_windows(path: str | os.PathLike, rows: int = 800, seed: int = 0) -> list[str]:
    """Write HSTU ranking windows with raw 64-bit item and user ids (`data=parquet_sequences`
    without a vocabulary: rows of 5 to 12 events of 60 items and 30 users, spread over the raw
    id space, half-star ratings, row groups of 64) to `path`; returns the overrides that train
    HSTU on it with managed item and user tables (`data.ids=managed`, 16 item rows, 12 user rows)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recsys_pipe.data.ids import MAX_INPUT_HASH_SIZE, spread_ids

    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 13, rows)
    items = spread_ids(rng.zipf(1.3, int(lengths.sum())) % 60, 2, MAX_INPUT_HASH_SIZE)
    users = spread_ids(rng.integers(0, 30, rows), 3, MAX_INPUT_HASH_SIZE)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    table = pa.table(
        {
            "user_id": pa.array(users),
            "item_ids": pa.ListArray.from_arrays(offsets, pa.array(items)),
            "timestamps": pa.ListArray.from_arrays(offsets, pa.array(np.arange(len(items), dtype=np.int64))),
            "actions": pa.ListArray.from_arrays(offsets, pa.array(rng.integers(1, 11, len(items)) / 2)),
        }
    )
    pq.write_table(table, path, row_group_size=64)
    return [
        "model=hstu_small",
        "data=parquet_sequences",
        f"data.path={path}",
        "data.max_seq_len=10",
        "data.num_candidates=2",
        "data.use_user_feature=true",
        "data.ids=managed",
        "data.item_rows=16",
        "data.user_rows=12",
        "model.sharding=row_wise",
    ]


def raw_id_sequences(path: str | os.PathLike, users: int = 240, seed: int = 0) -> list[str]:
    """Write user histories of raw 64-bit item ids (5 to 14 items of 400, Zipf-skewed, spread over
    the raw id space) for next-item retrieval to `path`: "user item" lines (`data=sequences`), or
    sequence Parquet with its item vocabulary where `path` ends in `.parquet`
    (`data=parquet_sequences`); returns the overrides that train on it with a managed item table
    of 24 rows (`data.ids=managed`)."""
    import numpy as np

    from recsys_pipe.data.ids import MAX_INPUT_HASH_SIZE, spread_ids

    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 15, users)
    items = spread_ids(rng.zipf(1.3, int(lengths.sum())) % 400, 4, MAX_INPUT_HASH_SIZE)
    owners = np.repeat(np.arange(users), lengths)
    if str(path).endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        from recsys_pipe.data.parquet.decode import item_vocab_metadata

        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        table = pa.table({"user_id": np.arange(users), "item_ids": pa.ListArray.from_arrays(offsets, pa.array(items))})
        pq.write_table(table.replace_schema_metadata(item_vocab_metadata(items)), path, row_group_size=64)
        source = ["data=parquet_sequences", f"data.path={path}", "data.shuffle=false"]
    else:
        with open(path, "w") as f:
            f.writelines(f"{u} {i}\n" for u, i in zip(owners, items, strict=True))
        source = ["data=sequences", f"data.path={path}", "data.shuffle=false"]
    return [
        *source,
        "data.eval_negatives=10",
        "data.max_seq_len=8",
        "model.max_seq_len=8",
        "data.ids=managed",
        "data.item_rows=24",
        "model.sharding=row_wise",
    ]


def parity_overrides(steps: int, device: str = "cpu", backend: str = "gloo") -> list[str]:
    """The overrides every parity worker trains its variants with: SGD, no progress bar, no
    evaluation, `steps` batches of 16 samples per rank and no step cap, on `device` with
    `backend`."""
    return [
        "optimizer=sgd",
        "trainer.progress_bar=false",
        "trainer.eval_every=0",
        f"trainer.device={device}",
        f"trainer.backend={backend}",
        "data.batch_size=16",
        f"data.num_batches={steps}",
        "trainer.max_steps=null",
    ]


def recsys_plan(run_dir: str | os.PathLike, *argv: str) -> int:
    """`recsys-plan argv...` in this process with its run directory at `run_dir` (`plan.txt` and
    the pictures go there); returns its exit code."""
    from recsys_pipe.cli.plan import run

    return run([*argv, f"hydra.run.dir={run_dir}"])


def train_here(*args: str) -> int:
    """`recsys-train args` in this process (torch and torchrec are imported already, a launch would
    import them again: a short run takes about a second); returns its exit code. The run's log
    handlers, the package's log level and the warning filters are as before afterwards."""
    import logging
    import warnings

    from recsys_pipe.cli import train as train_cli

    root, package = logging.getLogger(), logging.getLogger("recsys_pipe")
    handlers, level = list(root.handlers), package.level
    try:
        with warnings.catch_warnings():
            return train_cli.run(list(args))
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
            handler.close()
        package.setLevel(level)
