"""The named pipeline-parallel schedules as per-rank action lists (`build`).

The single-stage-per-rank ones are declared once, as lookaheads (`recsys_pipe.pp_schedules.lookahead`,
one YAML file each), and compiled to actions from there:

- `gpipe`: every forward before any backward.
- `1f1b` (PipeDream-flush): rank r runs `p-1-r` warm-up forwards, then alternates one forward
  and one full backward (`BW`), then the remaining backwards. At most `p-r` microbatches hold
  activations on rank r.
- `zb_h1` (Zero Bubble, memory-efficient): 1F1B's order with the backward split into `B`
  (input gradient, on the critical path) and `W` (weight gradient, off it). Rank r starts its
  W's only after `r` B's, so the W's it holds back fill the cool-down bubble; same activation
  memory as 1F1B.
- `zb_h2` (Zero Bubble, zero-bubble memory budget): `2(p-1-r)` warm-up forwards on rank r, then
  F-B-W with the W's held back by `2r`, turning the trapezoid into a parallelogram; up to
  `2p-1` microbatches hold activations on rank 0.

The others are not a lookahead pattern over one stage; they are generated here:

- `dualpipe` (DeepSeek-V3): two pipelines fed from both ends. Microbatches `0..m/2-1` enter at
  rank 0 and run stages `0..p-1` on ranks `0..p-1`; microbatches `m/2..m-1` enter at rank
  p-1 and run stages `p..2p-1` on ranks `p-1..0` (stage `p+k` computes the same model block
  as stage `k`: every rank holds two blocks, hence 2x parameters). Each rank follows
  DualPipe's eight phases; in the steady phase a forward of one direction and a full
  backward of the other run as one overlapped `FB` action, and some backwards are split into
  B and a later W to fill bubbles. Needs an even `p` and an even `m >= 2p`.
- `dualpipev` (DualPipe "cut in half", the V form torch's `ScheduleDualPipeV` runs): one
  pipeline of `2p` stages folded into a V, rank r holding stages r and `2p-1-r`; all `m`
  microbatches enter at rank 0 and the loss is on rank 0. Each rank follows DualPipe's eight
  phases over its two stages (the same order as torch's class). Needs `m >= 2p`.

Stage s of the single-stage-per-rank schedules runs on rank s.
"""

from __future__ import annotations

from collections.abc import Callable

from recsys_pipe.pp_schedules.actions import Action, PipelineSchedule
from recsys_pipe.pp_schedules.lookahead import LOOKAHEAD_SCHEDULES, lookahead_schedule

__all__ = ["SCHEDULES", "build"]


def build(name: str, p: int, m: int) -> PipelineSchedule:
    """The `name` schedule (`SCHEDULES`: "gpipe", "1f1b", "zb_h1", "zb_h2", "dualpipe",
    "dualpipev") for `p` ranks, `m` microbatches."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if p < 1 or m < 1:
        raise ValueError(f"need p >= 1 ranks and m >= 1 microbatches, got p={p}, m={m}")
    if name in LOOKAHEAD_SCHEDULES:
        return lookahead_schedule(name, p, m)
    return PipelineSchedule(_GENERATORS[name](p, m), name)


def _dualpipe(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    if p % 2 or m % 2 or m < 2 * p:
        raise ValueError(f"dualpipe needs an even number of ranks and an even m >= 2p, got p={p}, m={m}")
    half, chunks = p // 2, m // 2
    return tuple(_DualPipeRank.bidirectional(p, chunks, r).actions(half) for r in range(p))


def _dualpipev(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    if m < 2 * p:
        raise ValueError(f"dualpipev needs m >= 2p microbatches (one per stage), got p={p}, m={m}")
    return tuple(_DualPipeRank.v_shape(p, m, r).actions(p) for r in range(p))


class _DualPipeRank:
    """One rank's DualPipe order over its two phases: phase 0 is the one in which the rank sits
    at position h of its half of the pipeline (nearer the start), phase 1 the other.

    DualPipe (`bidirectional`): two directions of `chunks` microbatches each, h = min(r, p-1-r).
    DualPipeV (`v_shape`): one pipeline of 2p stages folded into a V, h = r, phase 0 its stage r
    and phase 1 its stage 2p-1-r; the phases' counts are DualPipe's with 2p ranks in halves of p.
    """

    def __init__(self, span: int, chunks: int, h: int, phase: tuple[tuple[int, int], tuple[int, int]]):
        self.p, self.chunks, self.h, self.phase = span, chunks, h, phase
        self.forwards = [0, 0]
        self.backwards = [0, 0]
        self.held_w: list[Action] = []

    @classmethod
    def bidirectional(cls, p: int, chunks: int, rank: int) -> _DualPipeRank:
        # (stage, first microbatch) of each phase: direction 0 runs stage r, direction 1 stage 2p-1-r
        forward_dir = (rank, 0)
        reverse_dir = (2 * p - 1 - rank, chunks)
        phase = (forward_dir, reverse_dir) if rank < p // 2 else (reverse_dir, forward_dir)
        return cls(p, chunks, min(rank, p - 1 - rank), phase)

    @classmethod
    def v_shape(cls, p: int, m: int, rank: int) -> _DualPipeRank:
        return cls(2 * p, m, rank, ((rank, 0), (2 * p - 1 - rank, 0)))

    def F(self, phase: int) -> Action:
        stage, base = self.phase[phase]
        j = base + self.forwards[phase]
        self.forwards[phase] += 1
        return Action("F", stage, j)

    def B(self, phase: int, split: bool) -> Action:
        """The next backward of `phase`: input gradient only (its W held back) if `split`."""
        stage, base = self.phase[phase]
        j = base + self.backwards[phase]
        self.backwards[phase] += 1
        if split:
            self.held_w.append(Action("W", stage, j))
            return Action("B", stage, j)
        return Action("BW", stage, j)

    def W(self) -> Action:
        return self.held_w.pop(0)

    def FB(self, forward_phase: int, backward_phase: int) -> Action:
        return Action("FB", parts=(self.F(forward_phase), self.B(backward_phase, split=False)))

    def actions(self, half: int) -> tuple[Action, ...]:
        h, out = self.h, []
        edge = half - h - 1  # ranks nearer the ends warm up longer
        out += [self.F(0) for _ in range(2 * edge)]  # 1: forwards of phase 0
        for _ in range(h + 1):  # 2: forwards of both phases
            out += [self.F(0), self.F(1)]
        for _ in range(edge):  # 3: split backward, its W at once, forward
            out += [self.B(1, split=True), self.W(), self.F(1)]
        for i in range(self.chunks - self.p + h + 1):  # 4: steady state, overlapped pairs
            if i == 0 and h == half - 1:  # the middle ranks do not overlap the first pair
                out += [self.F(0), self.B(1, split=False)]
            else:
                out.append(self.FB(0, 1))
            out.append(self.FB(1, 0))
        for _ in range(edge):  # 5: backward, overlapped pair
            out += [self.B(1, split=False), self.FB(1, 0)]
        split = False
        for i in range(h + 1):  # 6: backwards of both phases; the second half split
            if i == (h + 1) // 2 and h % 2 == 1:
                split = True
            out.append(self.B(1, split))
            if i == (h + 1) // 2 and h % 2 == 0:
                split = True
            out.append(self.B(0, split))
        for _ in range(edge):  # 7: a held-back W, a split backward
            out += [self.W(), self.B(0, split=True)]
        out += [self.W() for _ in range(h + 1)]  # 8: the remaining W's
        assert not self.held_w and self.forwards == self.backwards == [self.chunks] * 2
        return tuple(out)


#: the schedules generated here, not declared as lookaheads
_GENERATORS: dict[str, Callable[[int, int], tuple[tuple[Action, ...], ...]]] = {
    "dualpipe": _dualpipe,
    "dualpipev": _dualpipev,
}
#: every named schedule `build` makes
SCHEDULES: tuple[str, ...] = (*LOOKAHEAD_SCHEDULES, *_GENERATORS)
