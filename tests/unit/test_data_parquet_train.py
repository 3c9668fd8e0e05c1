"""Training on the Parquet sources in-process (1 rank, gloo): a run resumed mid-epoch trains
bitwise the losses of the uninterrupted run, under a lookahead plan with DataLoader workers, and
a bad row group met mid-run stops the run with its one line, its last checkpoint intact."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _process_group import one_rank_group

from recsys_pipe.config import ConfigError
from recsys_pipe.testing import fit_resumed, fit_run, parquet_criteo_overrides
from recsys_pipe.train import resolve_resume

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def info():
    with one_rank_group() as info:
        yield info


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """900 Criteo-layout rows in two files, row groups of 100; and sequence Parquet of 80 users."""
    from recsys_pipe.data.parquet.decode import item_vocab_metadata

    d = tmp_path_factory.mktemp("train")
    rng = np.random.default_rng(0)
    n = 900
    cols = {"label": pa.array(rng.integers(0, 2, n).astype(np.int8))}
    for i in range(13):
        cols[f"int_{i}"] = pa.array(rng.integers(0, 100, n))
    for i in range(26):
        cols[f"cat_{i}"] = pa.array(rng.integers(0, 2**20, n))
    table = pa.table(cols)
    (d / "criteo").mkdir()
    pq.write_table(table.slice(0, 500), d / "criteo" / "a.parquet", row_group_size=100)
    pq.write_table(table.slice(500), d / "criteo" / "b.parquet", row_group_size=100)
    users = np.arange(80)
    seqs = [list(rng.integers(0, 60, rng.integers(4, 12))) for _ in users]
    seq = pa.table({"user_id": pa.array(users), "item_ids": pa.array(seqs, pa.list_(pa.int64()))})
    pq.write_table(
        seq.replace_schema_metadata(item_vocab_metadata(np.concatenate(seqs))), d / "seq.parquet", row_group_size=20
    )
    return str(d / "criteo"), str(d / "seq.parquet")


def _criteo(path: str) -> list[str]:
    return [*parquet_criteo_overrides(path, 24), "trainer.eval_every=5"]


def test_a_resume_mid_epoch_is_bitwise_under_a_lookahead_plan_with_workers(info, files, tmp_path):
    """Epochs of 12 batches (2 held out): checkpoint at step 7, resume into epoch 2."""
    criteo, _ = files
    base = _criteo(criteo)
    reference = fit_run(info, [*base, "pipeline=serial"])
    assert len(reference.losses) == 24
    plan = [*base, "pipeline=sparse_dist", "data.num_workers=2"]
    first, second = fit_resumed(info, plan, 7, tmp_path / "a")
    assert first.losses + second.losses == reference.losses
    assert first.sample_ids[0].tolist() == reference.sample_ids[0].tolist()
    assert [s.tolist() for s in second.sample_ids] == [s.tolist() for s in reference.sample_ids[7:]]


def test_retrieval_trains_on_sequence_parquet_and_resumes_bitwise(info, files, tmp_path):
    _, seq = files
    base = [
        "trainer=smoke",
        "trainer.max_steps=10",
        "trainer.epochs=3",
        "trainer.log_every=100",
        "trainer.eval_every=5",
        "trainer.tensorboard=false",
        "model=sasrec",
        "data=parquet_sequences",
        f"data.path={seq}",
        "data.batch_size=16",
        "data.eval_negatives=10",
        "data.max_seq_len=8",
        "model.max_seq_len=8",
    ]
    reference = fit_run(info, base)
    first, second = fit_resumed(info, base, 4, tmp_path / "s")
    assert first.losses + second.losses == reference.losses
    assert reference.evals and "valid" in reference.evals[-1]


def test_a_bad_row_group_mid_run_stops_with_its_line_and_keeps_the_checkpoint(info, files, tmp_path):
    import shutil

    criteo, _ = files
    broken = tmp_path / "broken"
    shutil.copytree(criteo, broken)
    path = broken / "b.parquet"
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(2).column(5)
    data = bytearray(path.read_bytes())
    data[col.data_page_offset : col.data_page_offset + col.total_compressed_size] = b"\x00" * col.total_compressed_size
    path.write_bytes(bytes(data))
    overrides = [*_criteo(str(broken)), "data.shuffle=false", "trainer.checkpoint.interval=3", "trainer.eval_every=0"]
    with pytest.raises(ConfigError) as err:
        fit_run(info, overrides, run_dir=tmp_path / "run")
    text = str(err.value)
    assert text.startswith(f"data.path: {path}, row group 2: cannot be decoded (") and "\n" not in text
    # rows 700..799 are in the window of batches 9..11, pulled while step 9 trains (ahead of it):
    # the checkpoints of steps 3 and 6 stay, whole (resolve_resume refuses an incomplete one)
    assert resolve_resume(tmp_path / "run", "unused").name == "step_6"
