"""Build what a run trains with, once, from its config: the distributed model with its
optimizer, the `TrainState` for a compiled plan, and (`build_parts`) every finished part the
training loop runs on -- data, pipelines, evaluator, checkpointer, metrics writer -- with the
model's dense modules compiled in place under `trainer.compile=true` (`recsys_pipe.train.torch_compile`).

The model's config class decides the distribution (see `recsys_pipe.models.base`): a
`ShardedModelConfig` model's torchrec tables are sharded by `DistributedModelParallel`
(`model.sharding`), with the embedding optimizer fused into their backward; a plain
`ModelConfig` model is replicated under DDP and needs no torchrec (imported only for the sharded
path): torch's, or megatron-core's with `trainer.dense_ddp=megatron` (`recsys_pipe.train.dense_ddp`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recsys_pipe.config import CompiledPlan, ConfigError, ConfigProblem
from recsys_pipe.config.task_registry import Need
from recsys_pipe.data import RankData
from recsys_pipe.data.spec import DataSpec
from recsys_pipe.engine import SchedulablePipeline, SequentialExecutor, StreamPool, ThreadedExecutor
from recsys_pipe.models.base import ShardedModelConfig
from recsys_pipe.pp.config import data_replica, is_pipelined, pipelined_tables
from recsys_pipe.runtime.distributed import DistInfo
from recsys_pipe.runtime.verify import CollectiveGuard
from recsys_pipe.train.checkpoint import Checkpointer
from recsys_pipe.train.config import RunConfig
from recsys_pipe.train.dense_ddp import MegatronGrads, check_dense_ddp, megatron_ddp
from recsys_pipe.train.evaluation import Evaluator
from recsys_pipe.train.grad_accumulation import GradAccumulation
from recsys_pipe.train.metrics import MetricsWriter
from recsys_pipe.train.optim import TrainOptimizer, dense_optimizer_factory, sparse_optimizer
from recsys_pipe.train.progress import RunPosition
from recsys_pipe.train.reporting import Reporter
from recsys_pipe.train.resume import RunCheckpointer
from recsys_pipe.train.retrieval_eval import RetrievalEvaluation
from recsys_pipe.train.rng import RngState
from recsys_pipe.train.state import TrainState
from recsys_pipe.train.torch_compile import CompiledDense, compile_dense

__all__ = ["TrainParts", "build_model", "build_parts", "build_pipeline", "build_state", "describe_model", "rank_data"]


def _has_torchrec_tables(model: nn.Module) -> bool:
    """Without importing torchrec: its table modules can only exist once torchrec loaded them."""
    tables = sys.modules.get("torchrec.modules.embedding_modules")
    if tables is None:
        return False
    kinds = (tables.EmbeddingCollection, tables.EmbeddingBagCollection)
    return any(isinstance(m, kinds) for m in model.modules())


def build_model(run: RunConfig, info: DistInfo, spec: DataSpec, rng: RngState | None = None) -> tuple[nn.Module, Any]:
    """The configured model, distributed over the process group, and its optimizer; the same
    initial weights on every rank (seeded). Its dropout draws from `rng`'s dropout stream (by
    default a fresh one of `run.seed`: the stream a `Trainer` starts with)."""
    if is_pipelined(run):  # parallel.pp: this rank's stages, one module (recsys_pipe.pp.train)
        from recsys_pipe.pp.train import build_pipelined_model

        return build_pipelined_model(run, info, spec)
    check_dense_ddp(run, info.device.type)
    torch.manual_seed(run.seed)
    module = run.model.build(spec)
    (rng or RngState(run.seed, info.device)).attach(module)
    dense_factory = dense_optimizer_factory(run.optimizer)
    if isinstance(run.model, ShardedModelConfig):
        from recsys_pipe.models.sharding import make_optimizer, make_sharded_model

        embedding_opt, embedding_kwargs = sparse_optimizer(run.optimizer.sparse)
        model = make_sharded_model(
            module,
            run.model,
            dist.group.WORLD,
            info.device,
            batch_size=run.data.batch_size,
            embedding_optimizer=embedding_opt,
            embedding_optimizer_kwargs=embedding_kwargs,
        )
        return model, make_optimizer(model, dense_factory)
    if _has_torchrec_tables(module):
        raise ConfigError(
            ConfigProblem(
                "model.builder",
                f"model '{run.model.label}' has torchrec embedding tables but a plain ModelConfig: annotate its "
                "builder's config parameter with ShardedModelConfig (or a subclass) so the tables are sharded",
            )
        )
    module = module.to(info.device)
    if run.trainer.dense_ddp == "megatron":
        model = megatron_ddp(module)
    else:
        model = DistributedDataParallel(module, device_ids=[info.device] if info.device.type == "cuda" else None)
    return model, dense_factory(model.parameters())


def build_state(run: RunConfig, plan: CompiledPlan, model: nn.Module, optimizer: Any, info: DistInfo) -> TrainState:
    """The state the plan's tasks share: streams, torchrec's input distribution (sharded
    tables), the balancer (when a task of the plan needs it: `Need.BALANCER`), megatron-core's
    gradient buffers (`trainer.dense_ddp=megatron`)."""
    streams = StreamPool.create(plan.schedule.stream_slots, info.device)
    sparse_dist = None
    # pipelined: the first stage's sharded tables run their input distribution in its forward
    if isinstance(run.model, ShardedModelConfig) and not is_pipelined(run):
        from recsys_pipe.train.sparse_dist import TorchrecSparseDist

        sparse_dist = TorchrecSparseDist(model, info.device, streams, context=plan.config.torchrec_context)
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


def build_pipeline(plan: CompiledPlan, streams: StreamPool, state: TrainState) -> SchedulablePipeline:
    """A pipeline running `plan` on `streams`, with its own executor (and worker threads)."""
    executor = ThreadedExecutor(thread_map=dict(plan.thread_of)) if plan.threaded else SequentialExecutor()
    return SchedulablePipeline(plan.graph, streams, executor, state=state)


@dataclass
class TrainParts:
    """The finished parts a training loop runs on (`build_parts`): nothing in it is built later
    from the config, except the evaluation pipeline, which `evaluator` makes on first use."""

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
    #: the training pipeline (the plan on the state's streams)
    pipeline: SchedulablePipeline
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
    #: the model's compiled dense modules (`trainer.compile=true`), None in eager mode
    compiled: CompiledDense | None = None

    def close(self) -> None:
        """Release what the parts hold: pipeline threads, the state's resources, the metrics files."""
        self.pipeline.shutdown()
        self.evaluator.close()
        self.state.close()
        self.reporter.close()
        if self.compiled is not None:
            self.compiled.close()


def rank_data(run: RunConfig, rank: int, world_size: int) -> RankData:
    """This rank's data: its share of every batch, one share per data-parallel replica (the
    stages of one pipeline, `parallel.pp`, read the same batches)."""
    return RankData(run.data, *data_replica(run, rank, world_size), eval_batches=run.trainer.eval_batches)


def build_parts(
    run: RunConfig, plan: CompiledPlan, info: DistInfo, run_dir: str | None = None, data: RankData | None = None
) -> TrainParts:
    """Everything a run trains with, built once from its config (after the process group
    exists). With a `run_dir`, rank 0 writes metrics there and every rank takes part in
    checkpoints. `data` is this rank's `RankData` if the caller built it already."""
    cfg = run.trainer
    data = data or rank_data(run, info.rank, info.world_size)
    eval_loader = data.eval_loader()
    # a retrieval source's own validation/test evaluation (None for other sources)
    retrieval = RetrievalEvaluation.of(data, info.world_size, cfg.eval_dump, info.is_main, run.parallel.pp.size)
    # this rank's random streams (dropout, evaluation, the global generators), checkpointed
    rng = RngState(run.seed, info.device)
    rng.seed_globals()  # torch's is seeded by build_model
    steps = cfg.epochs * data.batches_per_epoch
    planned_steps = min(steps, cfg.max_steps) if cfg.max_steps is not None else steps
    model, optimizer = build_model(run, info, data.spec, rng)
    accumulate = cfg.grad_accumulation.steps
    train_optimizer = TrainOptimizer(optimizer, run.optimizer, -(-planned_steps // accumulate), model)
    state = build_state(run, plan, model, train_optimizer, info)
    if cfg.grad_accumulation.enabled:
        state.grad_accumulation = GradAccumulation(cfg.grad_accumulation, model)
    # after DMP and the sparse-dist rewrite (build_state): the modules are compiled where they are
    compiled = compile_dense(model, cfg.compile_options, run.model.label) if cfg.compile else None

    def verified(pipeline: SchedulablePipeline) -> SchedulablePipeline:
        """`pipeline` under `trainer.verify_collectives` (see `recsys_pipe.runtime.verify`)."""
        if cfg.verify_collectives != "off":  # startup: long enough for every task to run in prefill and steady state
            CollectiveGuard(pipeline, None if cfg.verify_collectives == "always" else plan.graph.max_lookahead + 2)
        return pipeline

    evaluator = Evaluator(
        state,
        data.spec.num_tasks,
        eval_loader,
        retrieval,
        lambda eval_state: verified(build_pipeline(plan, state.streams, eval_state)),
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
        lambda loss: _global_mean(model, info, loss),
        info.world_size // run.parallel.pp.size,
        retrieval,
        compiled,
    )
    return TrainParts(
        run=run,
        plan=plan,
        info=info,
        run_dir=run_dir,
        data=data,
        state=state,
        optimizer=train_optimizer,
        pipeline=verified(build_pipeline(plan, state.streams, state)),
        evaluator=evaluator,
        reporter=reporter,
        checkpointer=checkpointer,
        position=position,
        planned_steps=planned_steps,
        rng=rng,
        compiled=compiled,
    )


def _global_mean(model: nn.Module, info: DistInfo, value: torch.Tensor) -> float:
    replica_mean = getattr(model, "replica_mean", None)  # pipelined: over the replicas
    if replica_mean is not None:
        return replica_mean(value)
    value = value.detach().float().reshape(1).clone()
    if info.world_size > 1:
        dist.all_reduce(value)
        value /= info.world_size
    return float(value)


def describe_model(run: RunConfig, plan: CompiledPlan, world_size: int, local_size: int, device_type: str) -> str:
    """What `recsys-plan` shows about the model: how its tables are distributed (for torchrec
    tables, torchrec's printout of the sharding plan for this topology) and which tasks of the
    plan have nothing to do for it. The model is built on the meta device: no table memory."""
    from recsys_pipe.train.plan import idle_tasks

    lines = []
    if isinstance(run.model, ShardedModelConfig):
        from recsys_pipe.models.sharding import optimize_tables_in_backward, sharding_plan

        spec = run.data.spec()
        with torch.device("meta"):
            module = run.model.build(spec)
        cfg, ranks, where = run.model, world_size, ""
        if is_pipelined(run):  # the first stage's tables, over its data-parallel group (recsys_pipe.pp.train)
            ranks = max(1, world_size // run.parallel.pp.size)
            cfg, local_size, where = pipelined_tables(cfg), min(local_size, ranks), " (the first stage's replicas)"
        if cfg.compute_kernel == "fused":  # as in training
            optimize_tables_in_backward(module, *sparse_optimizer(run.optimizer.sparse))
        sharding = sharding_plan(module, cfg, ranks, device_type, local_size, batch_size=run.data.batch_size)
        lines.append(
            f"model: {run.model.label} (torchrec tables, model.sharding={run.model.sharding}; sharding plan for "
            f"{ranks} rank(s){where}, {local_size} per host, on {device_type})"
        )
        lines.append(str(sharding).strip("\n"))
    elif run.trainer.dense_ddp == "megatron":
        lines.append(
            f"model: {run.model.label} (plain torch tables, replicated on every rank under megatron-core's DDP; "
            "gradients all-reduced by finalize_model_grads)"
        )
    else:
        lines.append(f"model: {run.model.label} (plain torch tables, replicated on every rank under DDP)")
    idle = idle_tasks(plan, run)
    if idle:
        lines.append("tasks with nothing to do in this run:")
        lines += [f"  {name}: {reason}" for name, reason in idle.items()]
    return "\n".join(lines)
