"""A checkpoint that cannot be written: one error naming the checkpoint and the OS error, the
partial save removed, every earlier checkpoint kept (an injected ENOSPC, in one process; the
whole run on a real full tmpfs: tests/integration/test_clean_stops.py)."""

from __future__ import annotations

import errno
import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from recsys_pipe.runtime.status import RunStatus
from recsys_pipe.train.checkpoint import CheckpointConfig, Checkpointer, find_checkpoints
from recsys_pipe.train.checkpoint_errors import CheckpointWriteError, os_error_in


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_full_disk_is_one_error_and_keeps_every_earlier_checkpoint(tmp_path, monkeypatch, asynchronous):
    cfg = CheckpointConfig.model_validate({"interval": 1, "keep_latest": 0, "async": asynchronous})
    saver = Checkpointer(tmp_path, cfg, group=None, rank=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "torch.distributed is disabled"
        saver.save(1, {"weights": torch.arange(6.0)})
        saver.wait()
        monkeypatch.setattr(dcp_filesystem, "_write_item", _full_disk)
        with pytest.raises(CheckpointWriteError) as info:
            saver.save(2, {"weights": torch.arange(6.0) * 2})
            saver.wait()
    final = tmp_path / "checkpoints" / "step_2"
    assert str(info.value) == (
        f"cannot write checkpoint {final}: No space left on device (ENOSPC); the partial save was removed"
    )
    assert info.value.error.errno == errno.ENOSPC
    assert [c.step for c in find_checkpoints(tmp_path)] == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]  # no .step_2.partial


def test_other_errors_pass_unchanged(tmp_path, monkeypatch):
    saver = Checkpointer(tmp_path, CheckpointConfig(interval=1), group=None, rank=0)

    def broken(*args, **kwargs):
        raise ValueError("not an OS error")

    monkeypatch.setattr(dcp_filesystem, "_write_item", broken)
    with warnings.catch_warnings(), pytest.raises(BaseException) as info:
        warnings.simplefilter("ignore", UserWarning)
        saver.save(1, {"weights": torch.zeros(2)})
    assert not isinstance(info.value, CheckpointWriteError)


def test_the_os_error_is_found_in_a_ranks_failure():
    from torch.distributed.checkpoint.api import CheckpointException

    error = OSError(errno.EROFS, "Read-only file system")
    wrapped = CheckpointException("save failed", {1: (error, None)})
    assert os_error_in(wrapped) is error
    assert os_error_in(CheckpointException("x", {0: (ValueError("no"), None)})) is None


def _full_disk_in_torch_save(*args, **kwargs):
    """What a full disk looks like inside DCP's `torch.save` of a `.distcp` file: torch's zip
    writer's RuntimeError, with the OSError of the failed write only as its context."""
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None


def test_a_full_disk_inside_torch_save_reaches_the_other_ranks(tmp_path, monkeypatch):
    """DCP pickles a rank's failure to send it to the coordinator and back, which drops the
    exception's context: the rank's failure must be the OSError itself."""
    import pickle

    saver = Checkpointer(tmp_path, CheckpointConfig(interval=1), group=None, rank=0)
    monkeypatch.setattr(dcp_filesystem, "_write_item", _full_disk_in_torch_save)
    with warnings.catch_warnings(), pytest.raises(CheckpointWriteError) as info:
        warnings.simplefilter("ignore", UserWarning)
        saver.save(1, {"weights": torch.zeros(2)})
    assert info.value.error.errno == errno.ENOSPC
    as_sent = pickle.loads(pickle.dumps(info.value.__cause__))  # the CheckpointException, as a peer gets it
    error = os_error_in(as_sent)
    assert error is not None and error.errno == errno.ENOSPC and error.strerror == "No space left on device"
    assert not (tmp_path / "checkpoints" / ".step_1.partial").exists()


def test_a_status_record_on_a_full_disk_is_written_over_the_last_one(tmp_path, monkeypatch):
    """status.json on a full disk: the atomic replace has no room for its second file, so the
    record is written over the previous one in place; no temporary file is left."""
    status = RunStatus(str(tmp_path), world_size=2)
    assert status.write("running", pid=1)
    monkeypatch.setattr("recsys_pipe.runtime.status.os.replace", _full_disk)
    assert status.write("failed", exit_code=1, message="cannot write checkpoint x: No space left on device")
    monkeypatch.undo()
    record = json.loads((tmp_path / "status.json").read_text())
    assert record["status"] == "failed" and record["message"].startswith("cannot write checkpoint x")
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_a_status_record_that_cannot_be_written_is_a_warning(tmp_path, caplog):
    """A run directory gone: one warning naming the file and the OS error, no exception that
    would bury the run's own error."""
    status = RunStatus(str(tmp_path / "gone"), world_size=2)
    with caplog.at_level("WARNING", logger="recsys_pipe"):
        assert not status.write("failed", exit_code=1)
    assert [r.getMessage() for r in caplog.records] == [
        f"could not record status 'failed' in {tmp_path / 'gone' / 'status.json'}: No such file or directory"
    ]
