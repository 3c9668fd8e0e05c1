"""Where a run stands (`RunPosition`: the step and the next batch, checkpointed) and what one
`Trainer.fit` did (`TrainSummary`), shared by the loop and the parts that act on it: the
checkpointer saves the position, the reporter reads it for its log lines."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from recsys_pipe.train.torch_compile import CompileStats

__all__ = ["DATA_EXHAUSTED", "EPOCHS_DONE", "MAX_STEPS", "PREEMPTED", "RunPosition", "TrainSummary"]

#: `TrainSummary.stop_reason` values
MAX_STEPS, EPOCHS_DONE, DATA_EXHAUSTED, PREEMPTED = "max_steps reached", "epochs done", "data exhausted", "preempted"


@dataclass
class RunPosition:
    """How far a run has trained, over the whole run and across resumes (checkpointed)."""

    #: training steps taken: trained batches, so with gradient accumulation micro-steps (the
    #: optimizer steps every grad_accumulation.steps)
    step: int = 0
    #: the next training batch to train, counted across epochs
    batch: int = 0
    #: bad rows this rank's source skipped in the batches this run trained, by epoch (1-based;
    #: `data.on_bad_row=skip`; not checkpointed: a resumed run counts from where it resumed)
    skipped: Counter[int] = field(default_factory=Counter)


@dataclass
class TrainSummary:
    """What a `fit` did. Per-step `losses` and `sample_ids` are kept only with
    `fit(record_steps=True)` (parity checks): a long run must not grow memory per step."""

    steps: int = 0
    start_step: int = 0
    samples: int = 0
    seconds: float = 0.0
    first_loss: float | None = None
    last_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    sample_ids: list[torch.Tensor] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    #: why training stopped: one of MAX_STEPS, EPOCHS_DONE, DATA_EXHAUSTED, PREEMPTED
    stop_reason: str = ""
    #: the last checkpoint written (a directory), if any
    checkpoint: str | None = None
    #: what torch.compile did during this fit (`trainer.compile=true`), else None
    compiled: CompileStats | None = None
    #: `data.on_bad_row=skip`: the bad rows skipped over all ranks, `{"total": n, "per_epoch":
    #: {epoch: n}}`; None otherwise
    skipped: dict[str, Any] | None = None

    @property
    def end_step(self) -> int:
        """The step the run stands at after this `fit` (a resumed run starts above 0)."""
        return self.start_step + self.steps

    @property
    def samples_per_s(self) -> float:
        """Training throughput of this `fit`: samples over its wall-clock seconds, torch.compile's
        own seconds left out as the step lines leave them out (0 if none)."""
        seconds = self.seconds - (self.compiled.seconds if self.compiled is not None else 0.0)
        return self.samples / seconds if seconds > 0 else 0.0

    def describe(self) -> str:
        """One line for the log: steps, samples, speed, loss and eval AUC from first to last."""
        if not self.steps:
            return f"trained nothing: at step {self.start_step}, {self.stop_reason or 'no batch'}"
        evals = ""
        if self.evals and "auc" in self.evals[-1]:  # retrieval evaluations log their own line
            evals = f"; eval auc {self.evals[0]['auc']:.4f} -> {self.evals[-1]['auc']:.4f}"
        return (
            f"trained {self.steps} steps ({self.start_step} -> {self.end_step}), {self.samples} samples, "
            f"{self.samples_per_s:.1f} samples/s; loss {self.first_loss or float('nan'):.4f} -> "
            f"{self.last_loss or float('nan'):.4f}{evals}{self._compiled()}"
        )

    def _compiled(self) -> str:
        if self.compiled is None:
            return ""
        c = self.compiled
        return (
            f"; torch.compile: {c.seconds:.1f} s compiling (left out of samples/s), {c.graphs} graphs, "
            f"{c.graph_breaks} graph breaks, "
            f"{c.recompiles} recompiles"
        )
