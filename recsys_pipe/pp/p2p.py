"""Point-to-point transfer of a stage's activations and gradients between ranks.

A message is a tuple of tensors whose shapes may change from microbatch to microbatch (jagged
sequence batches), so each message is a fixed-size header (count, then per tensor its dtype
code, whether it requires a gradient, its rank and sizes) followed by the tensors. A received
tensor requires a gradient exactly when the sent one did, so the receiving stage computes (and
sends back) gradients only for what the sender's graph can use. Sends are asynchronous (`dist.isend`) and kept
until `wait_sends()`, so a rank never blocks on a peer that is busy with its own schedule;
receives block, which is what orders a stage after its producer.

A receive can be posted ahead (`post_recv`). gloo pairs a send with its receive by a
rendezvous: a send that finds the receive posted goes out at once, from the sending thread;
one posted first waits until the receiver asks, and then goes out from the sender's transport
thread, which on a busy machine competes for the core with the sender's own compute, so the
message arrives late ("Transfers" in docs/pipeline-parallel.md has the measurements). A plain
link posts a message's header ahead (the part of known size); a speculative one
(`PeerLink(speculative=True)`) its payload too, in the layout of the last message on that
peer and tag.

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

__all__ = ["FALLBACK", "PeerLink", "activation_tag", "gradient_tag"]

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
#: added to a tag for a payload sent after a speculative link's dummy (`PeerLink`): microbatch
#: indices stay below it
FALLBACK = 1 << 19


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


Layout = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


def _layout(specs: Sequence[tuple[torch.dtype, bool, tuple[int, ...]]]) -> Layout:
    return tuple((dtype, tuple(shape)) for dtype, _, shape in specs)


class PeerLink:
    """Sends and receives stage messages over the default process group (global ranks).

    `speculative=True` (both ends of a link alike): each (peer, tag) remembers the layout
    (dtypes and shapes) of its last message, so `post_recv` can post the payload's receive too,
    with that layout. A message of another layout still arrives: its sender first sends a
    dummy of the remembered layout on the tag (which the posted receive, or a plain `recv`,
    takes and drops), then the payload on the tag's fallback (`tag + FALLBACK`). Meant for
    stages whose messages keep their shapes from step to step (a jagged batch would pay a
    dummy per message).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, speculative: bool = False):
        self.group = group
        self.speculative = speculative
        self._pending: list[tuple[dist.Work, tuple[torch.Tensor, ...]]] = []
        #: (shape, dtype, requires_grad) of each tensor of the last message sent: what a
        #: measurement of the transfer time (`recsys_pipe.pp.transfer_time`) sends alike
        self.last_sent: tuple[tuple[torch.Size, torch.dtype, bool], ...] = ()
        self._layouts: dict[tuple[int, int], Layout] = {}  # (peer, tag) -> last layout (speculative)
        self._posted: dict[tuple[int, int], tuple[torch.Tensor, dist.Work, list[tuple[torch.Tensor, dist.Work]]]] = {}

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        self._pending.append((dist.isend(t, dst, group=self.group, tag=tag), (t,)))

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> None:
        """Post an asynchronous send of `tensors` to rank `dst`; `wait_sends()` completes it."""
        header = _header(tensors)
        self.last_sent = tuple((t.shape, t.dtype, t.requires_grad) for t in tensors)
        payload = tuple(t.detach().contiguous() for t in tensors)
        self._isend(header, dst, tag)
        payload_tag = tag
        if self.speculative:
            layout = tuple((t.dtype, tuple(t.shape)) for t in payload)
            known = self._layouts.get((dst, tag))
            self._layouts[dst, tag] = layout
            if known is not None and known != layout:  # fill the receive posted with the old layout
                for dtype, shape in known:
                    self._isend(torch.zeros(shape, dtype=dtype), dst, tag)
                payload_tag = tag + FALLBACK
        for t in payload:
            self._isend(t, dst, payload_tag)

    def post_recv(self, src: int, tag: int) -> None:
        """Post the receive of the message with `tag` from rank `src` now: its header, and with
        `speculative` its payload in the layout of the last message on (src, tag); `recv`
        completes it. At most one posted receive per (src, tag), and `recv` must follow (a
        posted receive takes the next message with its tag)."""
        if (src, tag) in self._posted:
            raise ValueError(f"a receive from rank {src} with tag {tag} is already posted")
        header = torch.empty(HEADER_SIZE, dtype=torch.int64)
        work = dist.irecv(header, src, group=self.group, tag=tag)
        payload = []
        for dtype, shape in self._layouts.get((src, tag), ()) if self.speculative else ():
            t = torch.empty(shape, dtype=dtype)
            payload.append((t, dist.irecv(t, src, group=self.group, tag=tag)))
        self._posted[src, tag] = (header, work, payload)

    def recv(self, src: int, tag: int) -> tuple[torch.Tensor, ...]:
        """Receive the message with `tag` from rank `src` (blocks until it arrives; posted by
        `post_recv` if it was); each tensor requires a gradient as the sent one did."""
        posted = self._posted.pop((src, tag), None)
        if posted is None:
            header, speculated = torch.empty(HEADER_SIZE, dtype=torch.int64), None
            dist.recv(header, src, group=self.group, tag=tag)
        else:
            header, work, speculated = posted
            work.wait()
        specs = _parse(header)
        payload_tag = tag
        if self.speculative:
            layout, known = _layout(specs), self._layouts.get((src, tag))
            self._layouts[src, tag] = layout
            if known is not None and known != layout:  # the sender's dummy of the old layout, dropped
                if speculated is None:
                    speculated = [(torch.empty(shape, dtype=dtype), None) for dtype, shape in known]
                    for t, _ in speculated:
                        dist.recv(t, src, group=self.group, tag=tag)
                for _, w in speculated:
                    if w is not None:
                        w.wait()
                speculated, payload_tag = None, tag + FALLBACK
        if speculated:
            for _, w in speculated:
                w.wait()
            return tuple(t.requires_grad_(g) for (t, _), (_, g, _) in zip(speculated, specs, strict=True))
        out = []
        for dtype, requires_grad, shape in specs:
            t = torch.empty(shape, dtype=dtype)
            dist.recv(t, src, group=self.group, tag=payload_tag)
            out.append(t.requires_grad_(requires_grad))
        return tuple(out)

    def wait_sends(self) -> None:
        """Complete every posted send (at the end of a step: the buffers may then be freed)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()
