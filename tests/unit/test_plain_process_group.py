"""The 1-rank group of a run started as a plain process (no torchrun): its store binds a port the
OS picks, and `teardown` takes the variables it wrote out of the environment again, so a second
run in the process, or a subprocess started afterwards, does not take them for torchrun's."""

import os

import torch.distributed as dist
from _process_group import DIST_ENV

from recsys_pipe.runtime import init_distributed, teardown


def test_runs_in_one_process_each_get_their_own_group_and_leave_no_environment(monkeypatch):
    for key in DIST_ENV:
        monkeypatch.delenv(key, raising=False)
    ports = []
    for _ in range(2):
        info = init_distributed("cpu", "gloo")
        assert (info.rank, info.world_size) == (0, 1) and dist.is_initialized()
        ports.append(os.environ["MASTER_PORT"])
        client = dist.TCPStore("127.0.0.1", int(ports[-1]), is_master=False)  # the group's own store
        client.set("probe", "1")
        teardown()
        assert not dist.is_initialized()
        assert [k for k in DIST_ENV if k in os.environ] == []


def test_teardown_keeps_what_torchrun_or_the_user_set(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    init_distributed("cpu", "gloo")
    os.environ["MASTER_ADDR"] = "localhost"  # changed after the group wrote it: not the group's any more
    teardown()
    assert os.environ.get("MASTER_ADDR") == "localhost" and "WORLD_SIZE" not in os.environ
