"""1-rank process groups for tests that train in-process, made and torn down in one place:
`one_rank_group` as a plain process makes it (a TCP store, its variables), `gloo_world` on an
in-memory store (the `gloo_world` fixture of conftest)."""

import contextlib
from collections.abc import Iterator

import pytest

#: what torchrun sets and a plain process's group writes for itself (`init_distributed`)
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def one_rank_group(start: bool = True) -> Iterator[object]:
    """A 1-rank process group as a plain process makes it (no torchrun variables around it, so
    a test's own never leak in), torn down afterwards. Yields its `DistInfo`; with `start=False`
    nothing is started here (a test that trains through the CLI starts it), only torn down."""
    from recsys_pipe.runtime import init_distributed, teardown

    with pytest.MonkeyPatch.context() as env:
        for key in DIST_ENV:
            env.delenv(key, raising=False)
        try:
            yield init_distributed("cpu", "gloo") if start else None
        finally:
            teardown()


@contextlib.contextmanager
def gloo_world() -> Iterator[object]:
    """A 1-rank gloo group on an in-memory store (no environment variables, no port), removed
    again; the group already there if the test made one. Yields the WORLD group."""
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if own_group:
            dist.destroy_process_group()
