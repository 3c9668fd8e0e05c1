"""PeerLink between two forked ranks: a receive posted ahead (`post_recv`) and a speculative
link's payload posted in the last layout deliver the sent tensors bitwise, also when the layout
changes (the dummy and the fallback tag), mixed with plain receives; `transfer_time` measures
a ping-pong on it and leaves the link clean for the next message."""

import multiprocessing
import os

import pytest
import torch

TAG = 7


def _message(i: int) -> tuple[torch.Tensor, ...]:
    """Layouts A, A, B, B, A, B: B adds an integer tensor and changes the first one's shape."""
    rows = 4 if i in (0, 1, 4) else 5
    first = (torch.arange(rows * 3, dtype=torch.float32) + i).reshape(rows, 3).requires_grad_(True)
    return (first,) if rows == 4 else (first, torch.tensor([i, 2 * i], dtype=torch.int64))


def _rank(rank: int, store_path: str, speculative: bool) -> None:
    import torch.distributed as dist

    from recsys_pipe.pp.p2p import PeerLink

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    link = PeerLink(speculative=speculative)
    for i in range(6):
        posted = i % 2 == 1 or i == 4  # posted ahead: the same layout (1, 3), a changed one (4)
        if rank == 1 and posted:
            link.post_recv(0, TAG)
        dist.barrier()
        if rank == 0:
            link.send(_message(i), 1, TAG)
            link.wait_sends()
        else:
            got, sent = link.recv(0, TAG), _message(i)
            assert len(got) == len(sent), (i, got)
            for a, b in zip(got, sent, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b.detach()) and a.requires_grad == b.requires_grad, i
    dist.barrier()
    dist.destroy_process_group()


def _ping_pong(rank: int, store_path: str, speculative: bool) -> None:
    import torch.distributed as dist

    from recsys_pipe.pp.p2p import PeerLink
    from recsys_pipe.pp.timeline import transfer_time

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    link = PeerLink(speculative=speculative)
    seconds = transfer_time(link, 1 - rank, _message(2) if rank == 0 else None, rounds=5)
    assert 0 < seconds < 10, seconds
    if rank == 0:  # the link still carries a stage message afterwards
        link.send(_message(3), 1, TAG)
        link.wait_sends()
    else:
        got = link.recv(0, TAG)
        assert all(torch.equal(a, b.detach()) for a, b in zip(got, _message(3), strict=True))
    dist.barrier()
    dist.destroy_process_group()


def _main(rank: int, store_path: str, speculative: bool, body=_rank) -> None:
    try:
        body(rank, store_path, speculative)
    except BaseException as exc:  # the parent reads the exit code
        print(f"rank {rank}: {exc!r}", flush=True)
        os._exit(1)
    os._exit(0)


def _run(tmp_path, speculative: bool, body) -> list:
    ctx = multiprocessing.get_context("fork")
    ranks = [ctx.Process(target=_main, args=(r, str(tmp_path / "store"), speculative, body)) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=60)
    for p in ranks:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in ranks]


@pytest.mark.parametrize("speculative", [True, False])
def test_posted_and_speculative_receives_deliver_every_message_bitwise(tmp_path, speculative):
    assert _run(tmp_path, speculative, _rank) == [0, 0]


@pytest.mark.parametrize("speculative", [True, False])
def test_transfer_time_measures_a_ping_pong_and_leaves_the_link_usable(tmp_path, speculative):
    assert _run(tmp_path, speculative, _ping_pong) == [0, 0]
