"""Point-to-point transfer of a stage's activations and gradients between ranks.

A message is a tuple of tensors whose shapes may change from microbatch to microbatch (jagged
sequence batches), so each message is a fixed-size header (count, then per tensor its dtype
code, whether it requires a gradient, its rank and sizes) followed by the tensors. A received
tensor requires a gradient exactly when the sent one did, so the receiving stage computes (and
sends back) gradients only for what the sender's graph can use. Sends are asynchronous (`dist.isend`) and kept
until `wait_sends()`, so a rank never blocks on a peer that is busy with its own schedule;
receives block, which is what orders a stage after its producer.

Hand-written rather than torch.distributed.pipelining's stage I/O: that code needs the shapes
fixed up front (shape inference on the first step), which jagged batches do not allow.

Tags keep the directions, the stages and the microbatches apart on one pair of ranks (a rank
may hold several stages whose transfers interleave): a receive matches exactly the send of the
same activation or gradient, whatever else is in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["PeerLink", "activation_tag", "gradient_tag"]

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
HEADER_SIZE = 64


_MICROBATCHES = 1 << 20


def activation_tag(stage: int, microbatch: int) -> int:
    """The tag of `microbatch`'s activation sent to `stage`."""
    return 2 * stage * _MICROBATCHES + microbatch


def gradient_tag(stage: int, microbatch: int) -> int:
    """The tag of `microbatch`'s output gradient sent back to `stage`."""
    return (2 * stage + 1) * _MICROBATCHES + microbatch


def _header(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    fields = [len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise TypeError(f"cannot send a {t.dtype} tensor between pipeline stages")
        fields += [_CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    if len(fields) > HEADER_SIZE:
        raise ValueError(
            f"a stage message of {len(tensors)} tensors needs {len(fields)} header fields (max {HEADER_SIZE})"
        )
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return header


def _parse(header: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    fields = header.tolist()
    count, pos, specs = fields[0], 1, []
    for _ in range(count):
        dtype, requires_grad, ndim = _DTYPES[fields[pos]], bool(fields[pos + 1]), fields[pos + 2]
        specs.append((dtype, requires_grad, tuple(fields[pos + 3 : pos + 3 + ndim])))
        pos += 3 + ndim
    return specs


class PeerLink:
    """Sends and receives stage messages over the default process group (global ranks)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self._pending: list[tuple[dist.Work, tuple[torch.Tensor, ...]]] = []
        #: (shape, dtype, requires_grad) of each tensor of the last message sent: what a
        #: measurement of the transfer time (`recsys_pipe.pp.transfer_time`) sends alike
        self.last_sent: tuple[tuple[torch.Size, torch.dtype, bool], ...] = ()

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> None:
        """Post an asynchronous send of `tensors` to rank `dst`; `wait_sends()` completes it."""
        header = _header(tensors)
        self.last_sent = tuple((t.shape, t.dtype, t.requires_grad) for t in tensors)
        payload = tuple(t.detach().contiguous() for t in tensors)
        for t in (header, *payload):
            self._pending.append((dist.isend(t, dst, group=self.group, tag=tag), (t,)))

    def recv(self, src: int, tag: int) -> tuple[torch.Tensor, ...]:
        """Receive the message with `tag` from rank `src` (blocks until it arrives); each tensor
        requires a gradient as the sent one did."""
        header = torch.empty(HEADER_SIZE, dtype=torch.int64)
        dist.recv(header, src, group=self.group, tag=tag)
        out = []
        for dtype, requires_grad, shape in _parse(header):
            t = torch.empty(shape, dtype=dtype)
            dist.recv(t, src, group=self.group, tag=tag)
            out.append(t.requires_grad_(requires_grad))
        return tuple(out)

    def wait_sends(self) -> None:
        """Complete every posted send (at the end of a step: the buffers may then be freed)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()
