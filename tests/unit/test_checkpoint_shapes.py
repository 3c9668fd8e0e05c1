"""What a checkpoint's metadata says before anything is loaded: a table of another shape than the
config's is named (`check_checkpoint`, before any process group), and a row-wise optimizer state
saved for another number of column shards gets its reason (`compare_state`, in DCP's planner)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from recsys_pipe.config import ConfigError
from recsys_pipe.train.checkpoint import CheckpointConfig, Checkpointer, check_checkpoint, compare_state

TABLE = "train.model.sparse.embedding_bags.{}.weight"


@pytest.fixture()
def checkpoint(tmp_path):
    saver = Checkpointer(tmp_path, CheckpointConfig(interval=1), group=None, rank=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "torch.distributed is disabled"
        state = {TABLE.format(name): torch.zeros(rows, 4) for name, rows in (("cat_0_table", 10), ("cat_1_table", 20))}
        saver.save(3, {**state, "train.model.dense.weight": torch.zeros(4, 4)})
    return tmp_path / "checkpoints" / "step_3"


def test_a_table_of_another_shape_is_named_before_loading(checkpoint):
    check_checkpoint(checkpoint, tables={"cat_0_table": (10, 4), "cat_1_table": (20, 4), "new_table": (5, 4)})
    with pytest.raises(ConfigError) as info:
        check_checkpoint(checkpoint, tables={"cat_0_table": (10, 4), "cat_1_table": (30, 4)})
    assert info.value.paths == ["trainer.resume_from"]
    assert f"checkpoint {checkpoint} does not fit this run: table cat_1_table is [20, 4] (rows, dim) in the " in str(
        info.value
    )
    assert "and [30, 4] in this config" in str(info.value) and "\n" not in str(info.value)


def test_row_wise_state_of_other_column_shards_says_why(tmp_path):
    key = "train.optim.optimizer.state.t.weight.t.momentum1"
    metadata = SimpleNamespace(state_dict_metadata={key: SimpleNamespace(size=torch.Size([2000]))}, storage_data={})
    with pytest.raises(
        ConfigError,
        match=r"momentum1 is \[2000\] in the checkpoint, \[1000\] here.*one value per row of each column shard",
    ):
        compare_state({key: torch.zeros(1000)}, metadata, tmp_path, 1)
    other = {key: SimpleNamespace(size=torch.Size([999]))}
    with pytest.raises(ConfigError) as info:
        compare_state(
            {key: torch.zeros(1000)}, SimpleNamespace(state_dict_metadata=other, storage_data={}), tmp_path, 1
        )
    assert "column shard" not in str(info.value)
