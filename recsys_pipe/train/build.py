"""Build what a run trains with, once, from its config: the distributed model with its
optimizer, the `TrainState` for a compiled plan, and (`build_parts`) every finished part the
training loop runs on -- data, plan runners, evaluator, checkpointer, metrics writer -- with the
model's dense modules compiled in place under `trainer.compile=true` (`recsys_pipe.train.torch_compile`).

How the model is spread over the ranks is chosen once, here, from the config
(`recsys_pipe.train.parallel.parallelism_of`): the chosen `Parallelism` builds the model, gives
each rank its data share, averages the loss over the replicas and lays out the optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from recsys_pipe.config import CompiledPlan
from recsys_pipe.config.task_registry import Need
from recsys_pipe.data import RankData
from recsys_pipe.data.batch import DataSpec
from recsys_pipe.engine import PlanRunner, SequentialExecutor, StreamPool, ThreadedExecutor
from recsys_pipe.runtime.distributed import DistInfo
from recsys_pipe.runtime.verify import CollectiveGuard
from recsys_pipe.train.checkpoint import Checkpointer
from recsys_pipe.train.config import RunConfig
from recsys_pipe.train.dense_ddp import MegatronGrads
from recsys_pipe.train.evaluation import Evaluator
from recsys_pipe.train.grad_accumulation import GradAccumulation
from recsys_pipe.train.metrics import MetricsWriter
from recsys_pipe.train.optim import TrainOptimizer
from recsys_pipe.train.parallel import Parallelism, parallelism_of
from recsys_pipe.train.progress import RunPosition
from recsys_pipe.train.reporting import Reporter
from recsys_pipe.train.resume import RunCheckpointer
from recsys_pipe.train.retrieval_eval import RetrievalEvaluation
from recsys_pipe.train.rng import RngState
from recsys_pipe.train.state import TrainState
from recsys_pipe.train.torch_compile import CompiledDense, compile_dense

__all__ = [
    "TrainParts",
    "build_model",
    "build_parts",
    "build_plan_runner",
    "build_state",
    "describe_model",
    "rank_data",
]


def build_model(
    run: RunConfig, info: DistInfo, spec: DataSpec, rng: RngState | None = None, parallelism: Parallelism | None = None
) -> tuple[nn.Module, Any]:
    """The configured model, spread over the process group as the run's `Parallelism` does, and
    its optimizer; the same initial weights on every rank (seeded). Its dropout draws from
    `rng`'s dropout stream (by default a fresh one of `run.seed`: the stream a `Trainer` starts with)."""
    parallelism = parallelism or parallelism_of(run)
    return parallelism.build_model(spec, info, rng or RngState(run.seed, info.device))


def build_state(
    run: RunConfig,
    plan: CompiledPlan,
    model: nn.Module,
    optimizer: Any,
    info: DistInfo,
    parallelism: Parallelism | None = None,
) -> TrainState:
    """The state the plan's tasks share: streams, the input distribution of sharded tables
    (`Parallelism.input_dist`), the balancer (when a task of the plan needs it: `Need.BALANCER`),
    megatron-core's gradient buffers (`trainer.dense_ddp=megatron`)."""
    streams = StreamPool.create(plan.task_graph.stream_slots, info.device)
    sparse_dist = (parallelism or parallelism_of(run)).input_dist(model, info, streams, plan)
    balancer = None
    if plan.needing(Need.BALANCER):
        from recsys_pipe.train.shuffle import BatchBalancer

        balancer = BatchBalancer(run.model.sample_costs)
    return TrainState(
        model=model,
        optimizer=optimizer,
        device=info.device,
        streams=streams,
        sparse_dist=sparse_dist,
        balancer=balancer,
        grad_buffers=MegatronGrads(model) if run.trainer.dense_ddp == "megatron" else None,
        autocast_dtype=torch.bfloat16 if run.trainer.precision == "bf16" else None,
    )


def build_plan_runner(plan: CompiledPlan, streams: StreamPool, state: TrainState) -> PlanRunner:
    """A plan runner running `plan` on `streams`, with its own executor (and worker threads)."""
    executor = ThreadedExecutor(thread_map=dict(plan.thread_of)) if plan.threaded else SequentialExecutor()
    return PlanRunner(plan.graph, streams, executor, state=state)


@dataclass
class TrainParts:
    """The finished parts a training loop runs on (`build_parts`): nothing in it is built later
    from the config, except the evaluation plan runner, which `evaluator` makes on first use."""

    #: the validated run config and its compiled plan
    run: RunConfig
    plan: CompiledPlan
    #: this rank's place in the job: rank, world size, device, process groups
    info: DistInfo
    #: the run directory (metrics, checkpoints, traces), None for a run that writes nothing
    run_dir: str | None
    #: this rank's share of the data (training and held-out batches)
    data: RankData
    #: what the plan's tasks share: model, optimizer, streams, input distribution, accumulation
    state: TrainState
    optimizer: TrainOptimizer
    #: the training plan runner (the plan on the state's streams)
    plan_runner: PlanRunner
    evaluator: Evaluator
    #: log lines, progress bar, `metrics.jsonl` and TensorBoard (rank 0 writes)
    reporter: Reporter
    #: saves checkpoints when due (with a run directory) and restores from one
    checkpointer: RunCheckpointer
    #: where the run stands: step and next batch (the checkpointer saves and restores it)
    position: RunPosition
    #: steps the run trains in all: `trainer.epochs` epochs, capped by `trainer.max_steps`
    planned_steps: int
    #: this rank's random streams: dropout, evaluation and the global generators (checkpointed)
    rng: RngState
    #: how the model is spread over the ranks (chosen once, from the config)
    parallelism: Parallelism
    #: the model's compiled dense modules (`trainer.compile=true`), None in eager mode
    compiled: CompiledDense | None = None

    def close(self) -> None:
        """Release what the parts hold: plan-runner threads, the state's resources, the metrics files."""
        self.plan_runner.shutdown()
        self.evaluator.close()
        self.state.close()
        self.reporter.close()
        if self.compiled is not None:
            self.compiled.close()


def rank_data(run: RunConfig, rank: int, world_size: int) -> RankData:
    """This rank's data: its share of every batch, one share per data-parallel replica
    (`Parallelism.data_share`: the ranks of one replica read the same batches)."""
    share = parallelism_of(run).data_share(rank, world_size)
    return RankData(run.data, *share, eval_batches=run.trainer.eval_batches)


def _verified(runner: PlanRunner, run: RunConfig, plan: CompiledPlan) -> PlanRunner:
    """`runner` under `trainer.verify_collectives` (see `recsys_pipe.runtime.verify`)."""
    mode = run.trainer.verify_collectives
    if mode != "off":  # startup: long enough for every task to run in prefill and steady state
        CollectiveGuard(runner, None if mode == "always" else plan.graph.max_lookahead + 2)
    return runner


def build_parts(
    run: RunConfig, plan: CompiledPlan, info: DistInfo, run_dir: str | None = None, data: RankData | None = None
) -> TrainParts:
    """Everything a run trains with, built once from its config (after the process group
    exists). With a `run_dir`, rank 0 writes metrics there and every rank takes part in
    checkpoints. `data` is this rank's `RankData` if the caller built it already."""
    cfg = run.trainer
    parallelism = parallelism_of(run)  # chosen once, here
    data = data or rank_data(run, info.rank, info.world_size)
    eval_loader = data.eval_loader()
    # a retrieval source's own validation/test evaluation (None for other sources)
    replica_ranks = parallelism.ranks_per_replica()
    retrieval = RetrievalEvaluation.of(data, info.world_size, cfg.eval_dump, info.is_main, replica_ranks)
    # this rank's random streams (dropout, evaluation, the global generators), checkpointed
    rng = RngState(run.seed, info.device)
    rng.seed_globals()  # torch's is seeded by build_model
    steps = cfg.epochs * data.batches_per_epoch
    planned_steps = min(steps, cfg.max_steps) if cfg.max_steps is not None else steps
    model, optimizer = parallelism.build_model(data.spec, info, rng)
    accumulate = cfg.grad_accumulation.steps
    train_optimizer = TrainOptimizer(
        optimizer, run.optimizer, -(-planned_steps // accumulate), model, flat_state=parallelism.flat_optimizer_state
    )
    state = build_state(run, plan, model, train_optimizer, info, parallelism)
    if cfg.grad_accumulation.enabled:
        state.grad_accumulation = GradAccumulation(cfg.grad_accumulation, model)
    # after DMP and the sparse-dist rewrite (build_state): the modules are compiled where they are
    compiled = compile_dense(model, cfg.compile_options, run.model.label) if cfg.compile else None

    evaluator = Evaluator(
        state,
        data.spec.num_tasks,
        eval_loader,
        retrieval,
        lambda eval_state: _verified(build_plan_runner(plan, state.streams, eval_state), run, plan),
        rng,
        every=cfg.eval_every,
        every_epochs=cfg.eval_epochs,
    )
    position = RunPosition()
    writer = None
    if run_dir is not None:
        writer = Checkpointer(run_dir, cfg.checkpoint, info.checkpoint_group, info.rank)
    checkpointer = RunCheckpointer(
        run, plan, info, data, state, train_optimizer, rng, retrieval, position, planned_steps, writer
    )
    reporter = Reporter(
        cfg,
        info,
        MetricsWriter(run_dir if info.is_main else None, tensorboard=cfg.tensorboard),
        train_optimizer,
        position,
        data.batches_per_epoch,
        lambda loss: parallelism.replica_mean(model, info, loss),
        parallelism.replicas(info.world_size),
        retrieval,
        compiled,
        skipping=run.data.on_bad_row == "skip",
    )
    return TrainParts(
        run=run,
        plan=plan,
        info=info,
        run_dir=run_dir,
        data=data,
        state=state,
        optimizer=train_optimizer,
        plan_runner=_verified(build_plan_runner(plan, state.streams, state), run, plan),
        evaluator=evaluator,
        reporter=reporter,
        checkpointer=checkpointer,
        position=position,
        planned_steps=planned_steps,
        rng=rng,
        parallelism=parallelism,
        compiled=compiled,
    )


def describe_model(run: RunConfig, plan: CompiledPlan, world_size: int, local_size: int, device_type: str) -> str:
    """What `recsys-plan` shows about the model: how it is spread over the ranks
    (`Parallelism.describe_model`: for torchrec tables, torchrec's printout of the sharding plan
    for this topology, built on the meta device) and which tasks of the plan have nothing to do
    for it."""
    from recsys_pipe.train.plan import idle_tasks

    lines = [parallelism_of(run).describe_model(plan, world_size, local_size, device_type)]
    idle = idle_tasks(plan, run)
    if idle:
        lines.append("tasks with nothing to do in this run:")
        lines += [f"  {name}: {reason}" for name, reason in idle.items()]
    return "\n".join(lines)
