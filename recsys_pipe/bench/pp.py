"""Pipeline-parallel schedules on this machine: each schedule's step time on recsys_pipe's engine
against torch.distributed.pipelining's own class on the same stages, and against what
`simulate()` predicts from the F / B / W times measured in the same run.

Two ranks (re-launched under torchrun), one intra-op thread each. The model is `recsys_pipe.pp.mlp`:
`--layers` Linear(`--width`) + ReLU layers and a regression head, split evenly over the stages;
`--batch` samples per step in `--microbatches` microbatches, SGD. For every schedule and
repetition, ours and torch's alternate (load on the machine hits both alike); a step is timed
from a barrier to the slower rank's end, optimizer included, after `--warmup` steps. Reports
median (min-max) over repetitions x steps.

    recsys-bench pp                       # the docs' table (a quiet machine: minutes)
    recsys-bench pp --quick --out /tmp/pp # tiny sizes, a smoke run
    recsys-bench pp --schedules 1f1b zb_h1 zb_h2

Prints a markdown table, then one JSON line. With `--out`, writes each schedule's measured and
simulated Gantt (`<schedule>_measured.png`, `<schedule>_simulated.png`).

Simulation: after each repetition's timed steps, one more step is recorded (every task's span
on each rank) and `simulate(orders, t_F, t_B, t_W, t_comm, t_send=...)` gets the means of that
step's F, B (input gradient) and W spans (a full backward BW counts as t_B, with t_W = 0;
means, not medians: on a loaded machine the durations skew long, and a makespan adds them up),
the transfer time `t_comm` measured just before the repetition (the median one-way time of
one microbatch's activation through the runtime's `PeerLink`, a ping-pong between the two
ranks: `recsys_pipe.pp.transfer_time`) and `t_send`, the mean of the recorded step's send
tasks. The simulator charges each activation or gradient one `t_comm` between the producer's
end and the consumer's start, which is what half a round trip measures, and the sending rank
one `t_send` (posting the message; with its receive posted ahead, writing it out). Its
makespan is compared with the recorded step's (first F to last compute end, the same step the
durations come from, so load on the machine hits both alike): median (min-max) of the
per-repetition ratios. The engine's own time between two tasks of a rank
(`recsys_pipe.pp.task_gaps`, median over both ranks) is reported beside it, not simulated, and
so is the time the slower rank spends in send tasks per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from recsys_pipe.autosched.pipeline_parallel import measured_result, simulate_measured
from recsys_pipe.bench.common import one_thread_per_rank, reexec_under_torchrun, run_ranks, summary
from recsys_pipe.engine import SpanRecorder
from recsys_pipe.pp import (
    ActionOrderRunner,
    PeerLink,
    PipelineParallelConfig,
    StageRuntime,
    TorchStageAdapter,
    compute_spans,
    gather_spans,
    mlp_stages,
    split_layers,
    task_gaps,
    transfer_time,
)
from recsys_pipe.pp import actions as action_tasks
from recsys_pipe.pp_schedules.actions import to_csv

SCHEDULES = ("gpipe", "1f1b", "zb_h1", "zb_h2", "interleaved_1f1b", "zbv", "dualpipev")
RANKS = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per repetition")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--out", type=Path, default=None, help="directory for the Gantt charts")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check that everything runs")
    args = parser.parse_args()
    if args.quick:
        args.width, args.layers, args.batch, args.microbatches = 64, 4, 16, 4
        args.steps, args.warmup, args.repeats = 2, 1, 1
    return args


class Bench:
    """One schedule's stages on this rank, for ours and for torch's runtime."""

    def __init__(self, name: str, args: argparse.Namespace, rank: int, link: PeerLink, csv_dir: str):
        self.name, self.args, self.rank, self.link = name, args, rank, link
        self.resolved = PipelineParallelConfig(size=RANKS, microbatches=args.microbatches, schedule=name).resolved()
        self.split = [list(r) for r in split_layers(args.layers, self.resolved.num_stages)]
        self.local = self.resolved.local_stages(rank)
        self.csv = os.path.join(csv_dir, f"{name}.csv")
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(args.batch, args.width, generator=g)
        self.y = torch.randn(args.batch, 1, generator=g)
        self.microbatches = [
            {"x": a, "y": b}
            for a, b in zip(self.x.chunk(args.microbatches), self.y.chunk(args.microbatches), strict=True)
        ]

    def ours(self):
        stages = mlp_stages(self.args.width, self.split)
        ranks, n = self.resolved.ranks_of_stages, len(self.split)
        runtimes = {
            s: StageRuntime(
                stages[s],
                s,
                n,
                prev_rank=ranks[s - 1] if s > 0 else None,
                next_rank=ranks[s + 1] if s < n - 1 else None,
                link=self.link,
            )
            for s in self.local
        }
        m = self.args.microbatches
        runner = ActionOrderRunner(runtimes, self.resolved.actions, self.rank, ranks, m, link=self.link)
        opt = torch.optim.SGD([p for s in self.local for p in stages[s].parameters()], lr=1e-4)

        def step(i: int) -> None:
            opt.zero_grad(set_to_none=True)
            runner.run_step(i, self.microbatches)
            opt.step()

        return step, runner

    def torch(self):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleDualPipeV,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleZBVZeroBubble,
        )
        from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

        stages = mlp_stages(self.args.width, self.split)
        n, mb = len(self.split), self.args.batch // self.args.microbatches
        adapters = [TorchStageAdapter(stages[s]) for s in self.local]
        pipeline_stages = [
            PipelineStage(
                adapter,
                s,
                n,
                torch.device("cpu"),
                input_args=torch.zeros(mb, self.args.width, requires_grad=s > 0),
                output_args=torch.zeros(mb, 1 if s == n - 1 else self.args.width, requires_grad=True),
            )
            for s, adapter in zip(self.local, adapters, strict=True)
        ]
        m = self.args.microbatches
        classes = {
            "gpipe": ScheduleGPipe,
            "1f1b": Schedule1F1B,
            "interleaved_1f1b": ScheduleInterleaved1F1B,
            "zbv": ScheduleZBVZeroBubble,
            "dualpipev": ScheduleDualPipeV,
        }
        if self.name in ("gpipe", "1f1b"):
            schedule = classes[self.name](pipeline_stages[0], m, loss_fn=F.mse_loss)
        elif self.name in classes:
            schedule = classes[self.name](pipeline_stages, m, loss_fn=F.mse_loss)
        else:  # zb_h1, zb_h2: our generator's order as a CSV on torch's runtime
            if self.rank == 0:
                to_csv(self.resolved.compute_orders(), self.csv)
            dist.barrier()
            schedule = _PipelineScheduleRuntime(pipeline_stages, m, loss_fn=F.mse_loss)
            schedule._load_csv(self.csv)
        opt = torch.optim.SGD([p for s in self.local for p in stages[s].parameters()], lr=1e-4)
        first, last = 0 in self.local, n - 1 in self.local

        def step(i: int) -> None:
            for adapter in adapters:
                adapter.begin_step(i)
            opt.zero_grad(set_to_none=True)
            kwargs = {"target": self.y, "losses": []} if last else {}
            schedule.step(*((self.x,) if first else ()), **kwargs)
            opt.step()

        return step


def timed(step, args: argparse.Namespace) -> list[float]:
    """Step times in ms (the slower rank's), after the warm-up steps."""
    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        step(i)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times.append(elapsed.item() * 1e3)
    return times


def simulated(bench: Bench, spans, t_comm: float, t_send: float) -> tuple[float, object]:
    """The step `simulate_measured` predicts from the measured spans, the transfer time `t_comm`
    and the sending rank's time per message `t_send` (ms), in ms; and the simulation."""
    result = simulate_measured(bench.resolved.compute_orders(), spans, t_comm / 1e3, t_send / 1e3)
    return result.makespan * 1e3, result


#: the task functions that send a stage's message
SEND_FNS = (action_tasks.send_f, action_tasks.send_b)


def send_durations(spans, runner) -> list[float]:
    """The durations of one rank's send tasks in one step (ms): the tasks of `runner` whose
    function is one of `SEND_FNS`."""
    sends = {task.name for task in runner.task_graph.tasks if any(task.fn is fn for fn in SEND_FNS)}
    return [(s.end_s - s.start_s) * 1e3 for s in spans if s.task in sends]


def transfer_ms(bench: Bench) -> float:
    """One microbatch's activation between the two ranks, one way (ms; `transfer_time`): rank 0
    sends the tensor the stages exchange, rank 1 echoes it."""
    mb = bench.args.batch // bench.args.microbatches
    message = (torch.zeros(mb, bench.args.width, requires_grad=True),) if bench.rank == 0 else None
    return transfer_time(bench.link, 1 - bench.rank, message) * 1e3


def main() -> None:
    """Time every schedule on this rank; rank 0 prints the table and the JSON line."""
    args = parse_args()
    one_thread_per_rank()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    link = PeerLink(speculative=True)  # the stages' messages keep their shapes
    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as csv_dir:
        csv_dir = [csv_dir]
        dist.broadcast_object_list(csv_dir, src=0)  # one host: rank 0's directory
        benches = {name: Bench(name, args, rank, link, csv_dir[0]) for name in args.schedules}
        times: dict[str, dict[str, list[float]]] = {name: {"ours": [], "torch": []} for name in benches}
        comm = {name: [] for name in benches}  # ms, one per repetition
        gaps = {name: [] for name in benches}  # ms, every rank's, the recorded steps'
        sends = {name: [] for name in benches}  # ms, the slower rank's, per recorded step
        recorded: dict[str, list] = {name: [] for name in benches}  # per repetition: (spans, t_comm, t_send)
        for _ in range(args.repeats):
            for name, bench in benches.items():
                t_comm = transfer_ms(bench)
                comm[name].append(t_comm)
                step, runner = bench.ours()
                times[name]["ours"] += timed(step, args)
                recorder = SpanRecorder()
                runner.plan_runner.observer = recorder
                step(args.warmup + args.steps)
                spans = gather_spans(compute_spans(recorder.spans(), rank))
                every: list = [None] * RANKS
                dist.all_gather_object(
                    every, (task_gaps(recorder.spans()), send_durations(recorder.spans(), runner.plan_runner))
                )
                gaps[name] += [g * 1e3 for rank_gaps, _ in every for g in rank_gaps]
                sends[name].append(max(sum(rank_sends) for _, rank_sends in every))
                t_send = statistics.mean(d for _, rank_sends in every for d in rank_sends)
                recorded[name].append((spans, t_comm, t_send))
                runner.shutdown()
                times[name]["torch"] += timed(bench.torch(), args)
        dist.barrier()
    if rank == 0:
        for name, bench in benches.items():
            sims = [simulated(bench, spans, t_comm, t_send) for spans, t_comm, t_send in recorded[name]]
            steps = [measured_result(spans).makespan * 1e3 for spans, _, _ in recorded[name]]
            ours, theirs = summary(times[name]["ours"]), summary(times[name]["torch"])
            report[name] = {
                "ours_ms": ours,
                "torch_ms": theirs,
                "speed_vs_torch": round(theirs["median"] / ours["median"], 3),
                "t_comm_ms": summary(comm[name]),
                "engine_gap_us": round(statistics.median(gaps[name]) * 1e3, 1),
                "send_ms_per_step": summary(sends[name]),
                "t_send_ms": summary(t_send for _, _, t_send in recorded[name]),
                "recorded_ms": summary(steps),
                "simulated_ms": summary(predicted for predicted, _ in sims),
                "recorded_over_simulated": summary(
                    (step / predicted for step, (predicted, _) in zip(steps, sims, strict=True)), digits=3
                ),
            }
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (spans, _, _), (predicted, sim) = recorded[name][-1], sims[-1]
                measured_result(spans, f"{name} measured").plot(args.out / f"{name}_measured.png")
                sim.plot(args.out / f"{name}_simulated.png", title=f"{name} simulated: makespan {predicted:.1f} ms")
        print(table(report))
        gains = zb_gains(report)
        print(json.dumps({"machine": machine(args), "schedules": report, "zb_gains_vs_1f1b": gains}))


def zb_gains(report: dict) -> dict:
    """ZB-H1's and ZB-H2's step-time gain over 1F1B, measured and simulated (ms)."""
    if "1f1b" not in report:
        return {}
    base = report["1f1b"]
    return {
        name: {
            "measured_ms": round(base["ours_ms"]["median"] - report[name]["ours_ms"]["median"], 3),
            "simulated_ms": round(base["simulated_ms"]["median"] - report[name]["simulated_ms"]["median"], 3),
        }
        for name in ("zb_h1", "zb_h2")
        if name in report
    }


def machine(args: argparse.Namespace) -> dict:
    keys = ("width", "layers", "batch", "microbatches", "steps", "warmup", "repeats")
    return {"ranks": RANKS, "threads_per_rank": 1, **{k: getattr(args, k) for k in keys}}


def table(report: dict) -> str:
    def fmt(s: dict, digits: int = 1) -> str:
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"

    rows = [
        "| schedule | ours ms | torch ms | torch / ours | t_comm ms | t_send ms | sends ms/step | engine gap µs "
        "| recorded step ms | simulated ms | recorded / simulated |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report.items():
        ratio = r["recorded_over_simulated"]
        rows.append(
            f"| {name} | {fmt(r['ours_ms'])} | {fmt(r['torch_ms'])} | {r['speed_vs_torch']:.2f}x | "
            f"{fmt(r['t_comm_ms'], 3)} | {fmt(r['t_send_ms'], 3)} | {fmt(r['send_ms_per_step'])} | "
            f"{r['engine_gap_us']:.0f} | "
            f"{fmt(r['recorded_ms'])} | "
            f"{fmt(r['simulated_ms'])} | {ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f}) |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    reexec_under_torchrun(__spec__.name, RANKS)  # plain `python -m recsys_pipe.bench.pp`: 2 ranks
    run_ranks(main)
