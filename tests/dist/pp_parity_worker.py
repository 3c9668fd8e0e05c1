"""Worker for test_pp_parity: run under torchrun (gloo, CPU), 2 ranks.

A stack of 4 Linear + ReLU + dropout layers with a regression head trains 2 SGD steps of 4
microbatches, split into stages in every way the tests compare:

- 2 stages, one per rank, under each lookahead schedule compiled to its action lists (GPipe,
  1F1B, ZB-H1, ZB-H2), under our ZB-H1 CSV, and under torch's
  ScheduleGPipe, Schedule1F1B and its runtime playing our ZB-H1 / ZB-H2 CSVs;
- 4 stages, two per rank, under Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble and
  DualPipeV: their action lists on our engine (as `parallel.pp.schedule` resolves them: torch's
  orders, our own dualpipev generator), and torch's classes themselves.

Rank 0 also trains the whole model in one process: as one stage on the same engine
(`parallel.pp.size=1`), and as a plain loop (forward, loss.backward per microbatch, grads / m).

Each rank saves `rank<r>.pt`: {variant: {"losses": [per step, per microbatch], "params":
{name: tensor}}}, parameters named by their layer in the whole model (`layer2.weight`,
`head.bias`), so every split compares with the one reference.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from recsys_pipe.autosched.pipeline_parallel import measured_result
from recsys_pipe.engine import SpanRecorder
from recsys_pipe.models.dropout import microbatch_seed
from recsys_pipe.models.hstu_cut import hstu_stages
from recsys_pipe.models.retrieval_cut import sasrec_stages
from recsys_pipe.pp import ChainedStages, PeerLink, StageRuntime
from recsys_pipe.pp.actions import ActionOrderRunner, stage_ranks
from recsys_pipe.pp.mlp import TorchStageAdapter, mlp_stages
from recsys_pipe.pp.schedules import resolve_schedule
from recsys_pipe.pp.timeline import compute_spans, gather_spans
from recsys_pipe.pp_schedules.actions import PipelineSchedule, from_csv, to_csv
from recsys_pipe.pp_schedules.generators import build
from recsys_pipe.testing import end_rank

WIDTH, BATCH, M, STEPS, P_DROP, LR = 32, 16, 4, 2, 0.2, 0.05
SPLIT2 = ((0, 1), (2, 3))
SPLIT4 = ((0,), (1,), (2,), (3,))
MULTI = {  # torch class -> stage layout, and our config's name for the schedule (None: none)
    "Interleaved1F1B": (ScheduleInterleaved1F1B, "loop", "interleaved_1f1b"),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, "loop", None),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, "v", "zbv"),
    "DualPipeV": (ScheduleDualPipeV, "v", "dualpipev"),  # our generator's order
}


def make_stages(split):
    return mlp_stages(WIDTH, split, P_DROP)


def make_opt(params):
    """SGD with momentum: optimizer state a resumed run must restore."""
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def make_data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 1, generator=g)) for _ in range(STEPS)]


def microbatches(x, y):
    return [{"x": a, "y": b} for a, b in zip(x.chunk(M), y.chunk(M), strict=True)]


def result(stages, losses):
    params = {}
    for stage in stages:
        params.update({n: p.detach().clone() for n, p in stage.named_by_layer().items()})
    return {"losses": losses, "params": params}


def train(runner, stages, data=None, timeline=None, steps=None, opt_state=None):
    """`timeline`: (rank,); the last step's compute spans are kept in "spans".
    `steps`: which steps of the data to run (default all); `opt_state`: the optimizer's state
    to start from (a resumed run); the result's "opt_state" is the state at the end."""
    opt = make_opt([p for s in stages for p in s.parameters()])
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    losses = []
    data = make_data() if data is None else data
    recorder = SpanRecorder()
    for step, (x, y) in enumerate(data):
        if steps is not None and step not in steps:
            continue
        if timeline is not None and step == len(data) - 1:
            runner.plan_runner.observer = recorder
        opt.zero_grad(set_to_none=True)
        out = runner.run_step(step, microbatches(x, y))
        losses.append([None if v is None else v.item() for v in out])
        opt.step()
    runner.shutdown()
    out = result(stages, losses)
    out["opt_state"] = opt.state_dict()
    if timeline is not None:
        out["spans"] = compute_spans(recorder.spans(), *timeline)
    return out


def runtimes(stages, local, ranks, link):
    n = len(stages)
    return {
        s: StageRuntime(
            stages[s],
            s,
            n,
            prev_rank=ranks[s - 1] if s > 0 else None,
            next_rank=ranks[s + 1] if s < n - 1 else None,
            link=link,
        )
        for s in local
    }


def lookahead_runner(runtimes_, schedule, p, rank, link):
    """The runner of a lookahead schedule: its action lists as `parallel.pp.schedule` resolves it."""
    resolved = resolve_schedule(schedule, p, M, None)
    return ActionOrderRunner(runtimes_, resolved.actions, rank, resolved.ranks_of_stages, M, link=link)


def run_plan(schedule, rank, link):
    stages = make_stages(SPLIT2)
    runner = lookahead_runner(runtimes(stages, [rank], (0, 1), link), schedule, 2, rank, link)
    return train(runner, [stages[rank]], timeline=(rank,))


def run_resumed(schedule, rank, link):
    """Step 0, then a checkpoint (the stage's parameters and optimizer state, through bytes), and
    step 1 in new stages, runtime and engine plan restored from it: no RNG state is saved (the
    dropout masks are keyed by step), nothing else carries over."""
    import io

    stages = make_stages(SPLIT2)
    runner = lookahead_runner(runtimes(stages, [rank], (0, 1), link), schedule, 2, rank, link)
    first = train(runner, [stages[rank]], steps={0})
    buffer = io.BytesIO()
    torch.save({"model": stages[rank].state_dict(), "opt": first["opt_state"]}, buffer)
    torch.manual_seed(12345)  # the global generator's state does not matter
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    stages = make_stages(SPLIT2)
    stages[rank].load_state_dict(checkpoint["model"])
    runner = lookahead_runner(runtimes(stages, [rank], (0, 1), link), schedule, 2, rank, link)
    second = train(runner, [stages[rank]], steps={1}, opt_state=checkpoint["opt"])
    second["losses"] = first["losses"] + second["losses"]
    return second


def run_actions(schedule, layout, split, rank, link):
    stages = make_stages(split)
    ranks = stage_ranks(2, len(split) // 2, layout)
    local = [s for s, r in enumerate(ranks) if r == rank]
    runner = ActionOrderRunner(runtimes(stages, local, ranks, link), schedule, rank, ranks, M, link=link)
    return train(runner, [stages[s] for s in local], timeline=(rank,))


def torch_stage(module, index, num_stages):
    adapter = TorchStageAdapter(module)
    mb_in = torch.zeros(BATCH // M, WIDTH, requires_grad=not module.first)  # received: needs a gradient
    mb_out = torch.zeros(BATCH // M, 1 if module.last else WIDTH, requires_grad=True)
    return adapter, PipelineStage(adapter, index, num_stages, torch.device("cpu"), input_args=mb_in, output_args=mb_out)


def run_torch(make_schedule, split, local):
    stages = make_stages(split)
    adapters, pipeline_stages = zip(*(torch_stage(stages[s], s, len(split)) for s in local), strict=True)
    schedule = make_schedule(list(pipeline_stages))
    opt = make_opt([p for s in local for p in stages[s].parameters()])
    losses = []
    for step, (x, y) in enumerate(make_data()):
        for adapter in adapters:
            adapter.begin_step(step)
        opt.zero_grad(set_to_none=True)
        args = (x,) if 0 in local else ()
        mb_losses = []
        kwargs = {"target": y, "losses": mb_losses} if len(split) - 1 in local else {}
        schedule.step(*args, **kwargs)
        losses.append([v.item() for v in mb_losses] if mb_losses else [None] * M)
        opt.step()
    return result([stages[s] for s in local], losses)


def csv_runtime(path):
    def make(stages):
        schedule = _PipelineScheduleRuntime(stages, M, loss_fn=F.mse_loss)
        schedule._load_csv(path)
        return schedule

    return make


def reference(split, runner_kind):
    stages = make_stages(split)
    module = ChainedStages(stages)
    if runner_kind == "engine":
        return train(lookahead_runner({0: StageRuntime(module, 0, 1)}, "1f1b", 1, 0, None), stages)
    opt = make_opt(module.parameters())
    losses = []
    for step, (x, y) in enumerate(make_data()):
        opt.zero_grad(set_to_none=True)
        step_losses = []
        for j, mb in enumerate(microbatches(x, y)):
            with microbatch_seed(step, j + (runner_kind == "shifted")):  # shifted: a control, other masks
                loss = module(mb, ())
            loss.backward()
            step_losses.append(loss.item())
        for p in module.parameters():
            p.grad.div_(M)
        losses.append(step_losses)
        opt.step()
    return result(stages, losses)


HSTU_SCHEDULES = ("1f1b", "zb_h1", "dualpipev")
SASREC_SCHEDULES = ("1f1b", "zb_h2")


def hstu_setup(num_layers):
    from recsys_pipe.data import SyntheticConfig, SyntheticDataConfig, make_dataloader
    from recsys_pipe.models import HSTUConfig, build_hstu

    data = SyntheticDataConfig(
        batch_size=8,
        max_seq_len=12,
        num_candidates=3,
        use_user_feature=True,
        synthetic=SyntheticConfig(num_items=100, num_users=50, num_clusters=4),
    )
    loader = make_dataloader(data)
    torch.manual_seed(0)
    model = build_hstu(HSTUConfig(max_seq_len=12, num_layers=num_layers, dropout=0.2), loader.dataset.spec)
    batches = [b for _, b in zip(range(STEPS), loader)]
    microbatches = [[b.select(torch.arange(j * 2, j * 2 + 2)) for j in range(M)] for b in batches]
    return model, microbatches


def train_hstu(runner, model, stages, microbatches):
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    losses = []
    for step, mbs in enumerate(microbatches):
        opt.zero_grad(set_to_none=True)
        out = runner.run_step(step, mbs)
        losses.append([None if v is None else v.item() for v in out])
        opt.step()
    runner.shutdown()
    mine = {id(p) for p in params}
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in mine}}


def sasrec_setup(num_blocks, out_dir, rank):
    from recsys_pipe.data import make_dataloader
    from recsys_pipe.data.in_memory.sequences import SequencesDataConfig
    from recsys_pipe.models.sasrec import SASRecConfig

    path = os.path.join(out_dir, f"sequences_rank{rank}.txt")  # one copy per rank: no waiting
    g = torch.Generator().manual_seed(0)
    lines = []
    for u in range(1, 61):
        n, start = int(torch.randint(2, 15, (1,), generator=g)), int(torch.randint(0, 40, (1,), generator=g))
        lines += [f"{u * 7} {(start + k) % 40 + 100}" for k in range(n)]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    data = SequencesDataConfig(path=path, batch_size=8, max_seq_len=20, eval_negatives=5)
    torch.manual_seed(0)
    cfg = SASRecConfig(dropout=0.0, num_blocks=num_blocks, embedding_dim=16, max_seq_len=20)
    model = cfg.build(data.dataset(0, 1).spec)
    batches = [b for _, b in zip(range(STEPS), make_dataloader(data))]
    microbatches = [[b.select(torch.arange(j * 2, j * 2 + 2)) for j in range(M)] for b in batches]
    return model, microbatches


def split_model(kind, num_stages, out_dir, rank):
    """(model, its stages of one layer each, the microbatches) of HSTU ranking or SASRec."""
    if kind == "hstu":
        model, microbatches = hstu_setup(num_stages)
        return model, hstu_stages(model, [[s] for s in range(num_stages)]), microbatches
    model, microbatches = sasrec_setup(num_stages, out_dir, rank)
    return model, sasrec_stages(model, [[s] for s in range(num_stages)]), microbatches


def run_model(kind, schedule, rank, link, out_dir):
    """A model split into stages (one layer each: 2 over 2 ranks, or 4 over dualpipev's 4)."""
    resolved = resolve_schedule(schedule, 2, M, None)
    model, stages, microbatches = split_model(kind, resolved.num_stages, out_dir, rank)
    local = resolved.local_stages(rank)
    runtimes_ = runtimes(stages, local, resolved.ranks_of_stages, link)
    runner = ActionOrderRunner(runtimes_, resolved.actions, rank, resolved.ranks_of_stages, M, link=link)
    return train_hstu(runner, model, [stages[s] for s in local], microbatches)


def model_reference(kind, num_layers, out_dir):
    model, stages, microbatches = split_model(kind, num_layers, out_dir, 0)
    runner = lookahead_runner({0: StageRuntime(ChainedStages(stages), 0, 1)}, "1f1b", 1, 0, None)
    return train_hstu(runner, model, stages, microbatches)


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    link = PeerLink()
    results = {}
    for schedule in ("gpipe", "1f1b", "zb_h1", "zb_h2"):
        results[f"ours/{schedule}"] = run_plan(schedule, rank, link)
    results["resumed/zb_h2"] = run_resumed("zb_h2", rank, link)
    csv_paths = {name: os.path.join(out_dir, f"{name}.csv") for name in ("zb_h1", "zb_h2")}
    if rank == 0:
        for name, path in csv_paths.items():
            to_csv(build(name, 2, M), path)
    dist.barrier()
    results["ours/csv_zb_h1"] = run_actions(from_csv(csv_paths["zb_h1"]), "loop", SPLIT2, rank, link)
    for name, (cls, layout, config_name) in MULTI.items():
        if config_name is None:
            actions = PipelineSchedule.of(get_schedule_ops(cls, 2, M, 2))
        else:  # as parallel.pp.schedule=<config_name> resolves it
            actions = resolve_schedule(config_name, 2, M, None).actions
        results[f"ours/{name}"] = run_actions(actions, layout, SPLIT4, rank, link)
    results["torch/ScheduleGPipe"] = run_torch(lambda s: ScheduleGPipe(s[0], M, loss_fn=F.mse_loss), SPLIT2, [rank])
    results["torch/Schedule1F1B"] = run_torch(lambda s: Schedule1F1B(s[0], M, loss_fn=F.mse_loss), SPLIT2, [rank])
    for name, path in csv_paths.items():
        results[f"torch/csv_{name}"] = run_torch(csv_runtime(path), SPLIT2, [rank])
    for name, (cls, layout, _) in MULTI.items():
        ranks = stage_ranks(2, 2, layout)
        local = [s for s, r in enumerate(ranks) if r == rank]
        results[f"torch/{name}"] = run_torch(lambda s, cls=cls: cls(s, M, loss_fn=F.mse_loss), SPLIT4, local)
    for schedule in HSTU_SCHEDULES:
        results[f"hstu/{schedule}"] = run_model("hstu", schedule, rank, link, out_dir)
    for schedule in SASREC_SCHEDULES:
        results[f"sasrec/{schedule}"] = run_model("sasrec", schedule, rank, link, out_dir)
    gathered = gather_spans(results["ours/zb_h1"]["spans"])
    if rank == 0:  # the measured Gantt of a ZB-H1 step (the test checks the file is drawn)
        measured_result(gathered, "zb_h1 (measured)").plot(os.path.join(out_dir, "zb_h1_measured.png"))
    if rank == 0:
        results["reference/engine"] = reference(SPLIT2, "engine")
        results["reference/loop"] = reference(SPLIT2, "loop")
        results["control/shifted_masks"] = reference(SPLIT2, "shifted")
        results["hstu/reference2"] = model_reference("hstu", 2, out_dir)
        results["hstu/reference4"] = model_reference("hstu", 4, out_dir)
        results["sasrec/reference2"] = model_reference("sasrec", 2, out_dir)
    for value in results.values():
        value.pop("opt_state", None)
    end_rank(os.path.join(out_dir, f"rank{rank}.pt"), results)


if __name__ == "__main__":
    main()
