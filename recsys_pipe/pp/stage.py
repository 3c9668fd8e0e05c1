"""One pipeline stage on one rank: forward (F), input gradient (B), weight gradient (W).

A stage module is an `nn.Module` called as `module(batch, inputs)`: `batch` is the microbatch
(every rank of a pipeline reads the same one; the first stage uses its features, the last its
labels) and `inputs` the tuple of tensors the previous stage produced (empty on the first
stage). It returns a tensor or a tuple of tensors for the next stage; the last stage returns
its loss (a scalar).

The backward split is torch.distributed.pipelining's own (`stage_backward_input`, then
`stage_backward_weight` over the graph it saved, and `stage_backward` for a full backward),
including its treatment of the first stage: its inputs need no gradient, so B does nothing
there and W runs the whole backward. Gradients of the microbatches add up in the parameters'
`.grad` in microbatch order and are scaled by 1/m once at the end of the step (`scale_grads`,
`div_`, as torch's schedules do), which is exactly what a one-rank loop over the same
microbatches computes.

The helpers come from a private torch module (`torch.distributed.pipelining._backward`): they
are what torch's own schedules run, so our B and W stay bitwise equal to torch's (the parity
tests compare against torch's classes, so a change there shows up as a failing test).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

from recsys_pipe.models.dropout import microbatch_seed
from recsys_pipe.pp.p2p import PeerLink, activation_tag, gradient_tag

__all__ = ["BackwardRecord", "ChainedStages", "ForwardRecord", "StageRuntime", "as_stage_input"]


@dataclass
class ForwardRecord:
    """What F keeps for the backward of one microbatch: the stage's inputs and outputs."""

    microbatch: int
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]  #: `(loss,)` on the last stage
    loss: torch.Tensor | None  #: detached, last stage only
    #: which inputs and outputs take part in the backward, taken at F: torch's backward helpers
    #: detach a stage's outputs in place, which may include an input passed through unchanged
    inputs_need_grad: tuple[bool, ...] = ()
    outputs_need_grad: tuple[bool, ...] = ()


@dataclass
class BackwardRecord:
    """What B leaves for W (and the input gradients to send back)."""

    forward: ForwardRecord
    output_grads: tuple[torch.Tensor | None, ...] | None
    input_grads: tuple[torch.Tensor, ...]
    param_groups: list[dict[str, Any]] | None = None
    full_backward_in_w: bool = False  #: first stage: W runs the whole backward


def as_stage_input(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Another stage's outputs as this stage's inputs: detached (each stage's graph ends at
    its inputs, so B can stop there), leaves that collect their gradient where the output was
    part of a graph (`requires_grad`). Received tensors (whose flag the sender's header set) and
    a hand-over between two stages of one rank go through this."""
    return tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)


def _as_tuple(value: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


class StageRuntime:
    """Runs stage `stage` of `num_stages` on this rank and talks to its neighbours.

    Args:
        module: the stage's module (see the module docstring for its call convention).
        stage, num_stages: this stage's index and the pipeline's length.
        prev_rank, next_rank: global ranks of the neighbouring stages (None at the ends).
        link: the point-to-point link (one per rank, shared by its stages).
        seed: base seed of the placement-independent dropout masks.
        dp_group: the ranks holding this stage in the other data-parallel replicas; their
            gradients are averaged at the end of each step (`reduce_grads`).
        summed_params: parameters whose gradients arrive already summed over `dp_group`: the
            first stage's torchrec-sharded tables, whose backward all-to-all adds every
            replica's gradient of the rows (as in an unpipelined run, where DDP leaves them
            out); `reduce_grads` leaves them alone.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        num_stages: int,
        *,
        prev_rank: int | None = None,
        next_rank: int | None = None,
        link: PeerLink | None = None,
        seed: int = 0,
        dp_group: dist.ProcessGroup | None = None,
        summed_params: Iterable[nn.Parameter] = (),
    ):
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} outside 0..{num_stages - 1}")
        self.module = module
        self.stage = stage
        self.num_stages = num_stages
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        if (prev_rank is None) != self.is_first or (next_rank is None) != self.is_last:
            raise ValueError(f"stage {stage} of {num_stages}: only the end stages have no neighbour")
        if link is None and num_stages > 1:
            raise ValueError("a pipeline of more than one stage needs a PeerLink")
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.link = link
        self.seed = seed
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.summed_params = list(summed_params)
        #: the optimizer step being run (part of the dropout key); set by the step runner
        self.step = 0
        #: added to the microbatch index in the dropout key: replica d's microbatch j is the
        #: step's global microbatch d * m + j, so replicas draw different masks; set per step
        self.microbatch_offset = 0

    # -- F --------------------------------------------------------------------------------------

    def post_recv_activation(self, microbatch: int) -> None:
        """Post the receive of `microbatch`'s activation ahead (`PeerLink.post_recv`): a
        sender that finds it posted sends at once; `recv_activation` completes it."""
        self.link.post_recv(self.prev_rank, activation_tag(self.stage, microbatch))

    def recv_activation(self, microbatch: int) -> tuple[torch.Tensor, ...]:
        """The next activation from the previous stage, as leaves that collect its gradient."""
        return as_stage_input(self.link.recv(self.prev_rank, activation_tag(self.stage, microbatch)))

    def forward(self, microbatch: int, batch: Any, inputs: tuple[torch.Tensor, ...] = ()) -> ForwardRecord:
        """Run the stage on one microbatch under its dropout key; the record backward needs."""
        with microbatch_seed(self.step, self.microbatch_offset + microbatch, self.seed):
            outputs = _as_tuple(self.module(batch, inputs))
        if self.is_last and (len(outputs) != 1 or outputs[0].dim() != 0):
            raise ValueError(f"the last stage must return its loss (a scalar), got {len(outputs)} tensor(s)")
        return ForwardRecord(
            microbatch,
            inputs,
            outputs,
            outputs[0].detach() if self.is_last else None,
            tuple(t.requires_grad for t in inputs),
            tuple(t.requires_grad for t in outputs),
        )

    def send_activation(self, record: ForwardRecord) -> None:
        """Send a forward's outputs to the next stage's rank."""
        self.link.send(record.outputs, self.next_rank, activation_tag(self.stage + 1, record.microbatch))

    # -- B / W ----------------------------------------------------------------------------------

    def post_recv_gradient(self, microbatch: int) -> None:
        """Post the receive of `microbatch`'s output gradients ahead; `recv_gradient` completes it."""
        self.link.post_recv(self.next_rank, gradient_tag(self.stage, microbatch))

    def recv_gradient(self, microbatch: int) -> tuple[torch.Tensor, ...]:
        """The gradients of `microbatch`'s outputs that require one, from the next stage."""
        return self.link.recv(self.next_rank, gradient_tag(self.stage, microbatch))

    def _backward_args(self, record: ForwardRecord, output_grads) -> tuple[Any, Any]:
        """What torch's backward helpers take: the loss itself on the last stage (its gradient
        is implicitly 1), else the outputs with the gradients the next stage sent back."""
        if self.is_last:
            return record.outputs[0], None
        grads = iter(output_grads)  # one per output that requires a gradient (what `_sendable` sends)
        return list(record.outputs), [next(grads) if needs else None for needs in record.outputs_need_grad]

    def backward_input(self, record: ForwardRecord, output_grads=None) -> BackwardRecord:
        """B: the gradient of the stage's inputs only; the weight gradient waits for W."""
        outputs, grads = self._backward_args(record, output_grads)
        if self.is_first:  # no input needs a gradient: W runs the whole backward (as torch does)
            return BackwardRecord(record, grads, (), None, full_backward_in_w=True)
        outputs = [outputs] if self.is_last else outputs
        input_grads, param_groups = stage_backward_input(outputs, grads, list(record.inputs), self.module.parameters())
        return BackwardRecord(record, grads, self._sendable(record, input_grads), param_groups)

    def backward_weight(self, record: BackwardRecord) -> None:
        """W: the weight gradient of a microbatch whose B ran, accumulated into `.grad`."""
        if record.full_backward_in_w:
            outputs = record.forward.outputs
            stage_backward(
                outputs[0] if self.is_last else list(outputs), record.output_grads, list(record.forward.inputs)
            )
        else:
            stage_backward_weight(self.module.parameters(), record.param_groups)
        record.param_groups = None

    def backward(self, record: ForwardRecord, output_grads=None) -> BackwardRecord:
        """B and W as one full backward."""
        outputs, grads = self._backward_args(record, output_grads)
        input_grads = stage_backward(outputs, grads, list(record.inputs))
        return BackwardRecord(record, grads, self._sendable(record, input_grads))

    def _sendable(self, record: ForwardRecord, input_grads) -> tuple[torch.Tensor, ...]:
        """One gradient per input that requires one (zeros where the input was unused)."""
        out = []
        for inp, needs, grad in zip(record.inputs, record.inputs_need_grad, input_grads, strict=True):
            if needs:
                out.append(torch.zeros_like(inp) if grad is None else grad)
        return tuple(out)

    def send_gradient(self, record: BackwardRecord) -> None:
        """Send a backward's input gradients to the previous stage's rank."""
        self.link.send(record.input_grads, self.prev_rank, gradient_tag(self.stage - 1, record.forward.microbatch))

    # -- the step -------------------------------------------------------------------------------

    def scale_grads(self, num_microbatches: int) -> None:
        """Divide the summed gradients by the number of microbatches (torch's `scale_grads`)."""
        if num_microbatches != 1:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.div_(num_microbatches)

    def begin_step(self, step: int, num_microbatches: int) -> None:
        """Set the dropout key's step and this replica's microbatch offset."""
        self.step = step
        self.microbatch_offset = self.dp_rank * num_microbatches

    def end_step(self, num_microbatches: int) -> None:
        """The step's gradients: scaled by 1/m, then averaged over the data-parallel replicas."""
        self.scale_grads(num_microbatches)
        self.reduce_grads()

    def reduce_grads(self) -> None:
        """Average the gradients over `dp_group`, as DDP does: each divided by the group's size,
        then summed (one all-reduce over the stage's gradients, flattened), except the
        `summed_params`' (already summed by their own backward).

        Hand-written rather than DDP: DDP's reducer hooks the autograd accumulation of each
        parameter, which the weight-gradient step (`stage_backward_weight` adds into `.grad`
        itself) bypasses; torch's pipelining likewise reduces outside autograd."""
        if self.dp_group is None:
            return
        summed = {id(p) for p in self.summed_params}
        params = [p for p in self.module.parameters() if p.requires_grad and id(p) not in summed]
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.dp_size)
        dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


class ChainedStages(nn.Module):
    """Stage modules run one after another as one stage: the whole model on one rank, with
    the same modules (and so the same parameters and dropout layers) as the split run."""

    def __init__(self, stages: Sequence[nn.Module]):
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, batch: Any, inputs: tuple[torch.Tensor, ...] = ()) -> Any:
        value: Any = inputs
        for module in self.stages:
            value = _as_tuple(module(batch, value))
        return value[0] if len(value) == 1 else value
