"""`trainer.resume_from=latest` resumes only the same experiment (model, data, global batch: the
fingerprint saved with every checkpoint); newer checkpoints of other runs in the same output
directory are passed over and named in the log; with only other experiments' checkpoints the run
is refused in one line naming the newest and how to force it. A global batch other than the
checkpoint's is refused by `--check` where the epoch could not continue exactly (a streaming
source)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_pipe.config import ConfigError
from recsys_pipe.testing import load_run, train_here
from recsys_pipe.train.fingerprint import FINGERPRINT_FILE
from recsys_pipe.train.preflight import check_resume

pytestmark = pytest.mark.timeout(300)

COMMON = [
    "model=dlrm_torch",
    "data=criteo_synthetic",
    "data.synthetic.num_samples=256",
    "data.batch_size=8",
    "data.num_batches=null",
]
COMMON += ["data.num_embeddings=50", "trainer=smoke", "trainer.max_steps=2", "trainer.checkpoint.interval=2"]
COMMON += ["trainer.eval_every=0", "trainer.eval_batches=1", "trainer.tensorboard=false"]


def _runs(out: Path) -> list[Path]:
    return sorted((out / "recsys-train").iterdir())


def test_latest_takes_the_newest_checkpoint_of_this_experiment(tmp_path, capsys):
    out = f"trainer.output_dir={tmp_path}"
    assert train_here(*COMMON, out) == 0  # A
    assert train_here(*COMMON, out, "data.seed=1") == 0  # B: other data, written after A
    a, b = _runs(tmp_path)
    choice = check_resume(load_run(*COMMON, out, "trainer.resume_from=latest"), 1)
    assert choice.path == a / "checkpoints" / "step_2"
    assert choice.skipped == ((b / "checkpoints" / "step_2", "data.seed is 1 there, 0 here"),)
    # a checkpoint written before fingerprints were saved: fingerprinted from its run's config.yaml
    (a / "checkpoints" / "step_2" / FINGERPRINT_FILE).unlink()
    assert check_resume(load_run(*COMMON, out, "trainer.resume_from=latest"), 1).path == choice.path
    # the global batch is what counts: 2 replicas of 4 rows train A's 8 rows per step
    assert check_resume(load_run(*COMMON, out, "trainer.resume_from=latest", "data.batch_size=4"), 2) == choice
    with pytest.raises(ConfigError, match="no checkpoint under .* is of this experiment"):  # 16 rows a step
        check_resume(load_run(*COMMON, out, "trainer.resume_from=latest"), 2)
    # the run resumes from A's checkpoint and says which it passed over
    assert train_here(*COMMON, out, "trainer.resume_from=latest", "trainer.max_steps=3") == 0
    resumed = _runs(tmp_path)[-1]
    assert json.loads((resumed / "status.json").read_text())["resumed_from"] == str(choice.path)
    log = (resumed / "train.log").read_text()
    assert f"skipped {b / 'checkpoints' / 'step_2'}, a checkpoint of another experiment (data.seed is 1" in log
    capsys.readouterr()


def test_latest_with_only_other_experiments_is_refused_in_one_line(tmp_path, capsys):
    out = f"trainer.output_dir={tmp_path}"
    assert train_here(*COMMON, out, "data.seed=1") == 0
    (b,) = _runs(tmp_path)
    capsys.readouterr()
    assert train_here("--check", *COMMON, out, "trainer.resume_from=latest") == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        f"error: trainer.resume_from: latest: no checkpoint under {tmp_path} is of this experiment; the newest, "
        f"{b / 'checkpoints' / 'step_2'}, is of another (data.seed is 1 there, 0 here); to continue from it anyway "
        f"set trainer.resume_from={b / 'checkpoints' / 'step_2'}"
    )
    assert len(err) == 2  # and the summary line: printed once
    forced = f"trainer.resume_from={b / 'checkpoints' / 'step_2'}"
    assert train_here("--check", *COMMON, out, forced) == 0


def test_check_refuses_another_global_batch_on_a_streaming_source(tmp_path, capsys):
    rng = np.random.default_rng(0)
    columns = {"label": rng.integers(0, 2, 128).astype(np.int8)}
    columns |= {f"int_{i}": rng.integers(0, 100, 128) for i in range(13)}
    columns |= {f"cat_{i}": rng.integers(0, 1000, 128) for i in range(26)}
    pq.write_table(pa.table(columns), tmp_path / "c.parquet")
    args = ["model=dlrm_torch", "data=parquet", f"data.path={tmp_path / 'c.parquet'}", "data.num_embeddings=50"]
    args += [*COMMON[5:], f"trainer.output_dir={tmp_path / 'runs'}", "data.batch_size=8"]
    assert train_here(*args) == 0
    (run,) = _runs(tmp_path / "runs")
    capsys.readouterr()
    assert train_here("--check", *args, f"trainer.resume_from={run}", "data.batch_size=4") == 2
    line = capsys.readouterr().err.splitlines()[0]
    assert line.startswith(f"error: data.batch_size: the checkpoint {run / 'checkpoints' / 'step_2'} trained a ")
    assert line.endswith(
        "global batch of 8 rows; this run's is 4 (1 replica(s) x data.batch_size=4), and the epoch "
        "would not continue exactly: set data.batch_size=8"
    )
