"""Prototype: the torchrec call recipe behind the recommendation-training task set (SPEC §8).

Run: ``.venv/bin/torchrun --nproc_per_node 2 scripts/proto_torchrec_pipeline.py [--steps 20]``
(gloo, CPU; also runs on 1 rank). Builds the sharded HSTU model from the same seed four times
and trains the same batches with

  (a) a plain loop: ``loss, aux = model(batch); loss.backward(); opt.step()``;
  (b) torchrec's ``TrainPipelineSparseDist``;
  (c) a hand-driven pipeline: the torchrec internals called one task at a time, fired exactly
      as the engine fires tasks (h2d at lookahead 2, input dist at lookahead 1, the rest at 0);
  (d) (c) with the prefetch variant (``PrefetchTrainPipelineContext`` + ``_prefetch_embeddings``
      + ``PrefetchPipelinedForward``);

and asserts that per-step losses, the trained sample ids and the final parameters (dense and
every local embedding shard) are bitwise equal across the four.

Recipe (torchrec 1.8.0; ``tp`` = ``torchrec.distributed.train_pipeline``)
==========================================================================
Streams: on CPU every stream argument is ``None`` (a stream makes the pipelined forwards call
``record_stream``, which CPU tensors do not support). On CUDA pass the engine's streams:
``dist_stream`` = the data_dist stream, ``default_stream`` = the default stream.

Per-batch state (the engine's slots): ``batch`` (device batch), ``context`` (one context object
per batch, never shared), ``loss``/``aux`` (forward output).

bootstrap (once, first batch B0, before any task):
    ctx0 = tp.pipeline_context.TrainPipelineContext(index=0, version=1)
           (prefetch: PrefetchTrainPipelineContext(index=0, version=1))
    batch0 = cpu_batch0.to(device, non_blocking=True)
    pipelined_modules, model, _orig_fwds, _postprocs, not_pipelined = tp.utils._rewrite_model(
        model=dmp, context=ctx0, dist_stream=None, batch=batch0, apply_jit=False,
        pipelined_forward=tp.runtime_forwards.PipelinedForward   # or PrefetchPipelinedForward
        , pipeline_postproc=False, default_stream=None)
      - FX-traces dmp.module with every submodule lacking a ShardedModule as a leaf; for each
        call of a ShardedModule it rebuilds the argument from the traced getattr chain on the
        forward's input (here ``batch.sparse_features``) and replaces ``module.forward`` with
        ``PipelinedForward(name, call_args, module, ctx0, dist_stream)``. ``model`` is dmp
        itself (a new GraphModule only with apply_jit). ``not_pipelined`` must be empty.
    tp.utils._start_data_dist(pipelined_modules, batch0, ctx0)      # collective: splits a2a
      - first call initialises each sharded module's input dists (lazily, from this batch).
    tp.utils._override_input_dist_forwards(pipelined_modules)
      - swaps each ``KJTAllToAll.forward`` for ``KJTAllToAllForward`` so later
        ``_start_data_dist`` calls only build split metadata and ``_fuse_input_dist_splits``
        issues ONE fused splits all-to-all per process group. Needs the input dists initialised,
        hence the ``_start_data_dist`` above. B0's input dist is therefore already started:
        the engine must skip h2d and start_input_dist for B0 (here: ``dist_started`` flag).

h2d (la 2, memcpy stream):
    batch = cpu_batch.to(device, non_blocking=True)
    ctx = TrainPipelineContext(index=k, version=1)          (prefetch: PrefetchTrainPipelineContext)
    Reads the CPU batch; writes batch + a fresh context. No collective.

start_input_dist (la 1, data_dist stream, nccl):
    tp.utils._start_data_dist(pipelined_modules, batch, ctx)
    For each pipelined module: args = forward.args.build_args_kwargs(batch) (i.e.
    batch.sparse_features), ``module.preprocess_input``, ``module_ctx = module.create_context()``.
    WRITES ctx.module_contexts[name] = module_ctx, ctx.input_dist_splits_requests[name] =
    module.input_dist(module_ctx, kjt) (split metadata; KJT permuted per shard), then
    ctx.fused_splits_awaitables += [(names, FusedKJTListSplitsAwaitable)] whose constructor
    ISSUES the fused splits all-to-all (collective, async). Does not touch ``forward``'s context.
    On CUDA run it under the data_dist stream after waiting for the h2d event.

wait_input_dist (la 1, data_dist stream, nccl):
    for names, fused in ctx.fused_splits_awaitables:
        for name, request in zip(names, fused.wait()):  # waits the splits a2a, ISSUES the
            ctx.input_dist_tensors_requests[name] = request  # tensors a2a (async, collective)
    ctx.input_dist_splits_requests.clear(); ctx.fused_splits_awaitables.clear()
    (= ``TrainPipelineSparseDist.wait_sparse_data_dist``.) READS fused_splits_awaitables,
    WRITES input_dist_tensors_requests[name] (a KJTListAwaitable).

prefetch_embeddings (prefetch variant only; la 1, prefetch stream; after forward of la 0):
    data = tp.utils._prefetch_embeddings(batch, ctx, pipelined_modules, device,
               stream_context=torch.cuda.stream, data_dist_stream=None, default_stream=None)
    for name, d in data.items():
        ctx.module_input_post_prefetch[name] = d
        ctx.module_contexts_post_prefetch[name] = ctx.module_contexts.pop(name)
    POPS ctx.input_dist_tensors_requests[name] and waits it (tensors a2a done), calls
    ``module.prefetch(ctx=module_ctx, dist_input=data, forward_stream=default_stream)`` (cache
    warm-up; no-op for the FUSED kernel / on CPU), returns {name: dist KJTList}. The two
    ``*_post_prefetch`` writes are the caller's job (the public ``prefetch_embeddings`` does them
    but returns early when ``data_dist_stream is None``, i.e. always on CPU; that is why
    ``PrefetchTrainPipelineSparseDist`` fails on CPU). With streams: pass the data_dist stream
    and the default stream; the function does wait_stream + record_stream itself.

zero_grad (la 0): opt.zero_grad()

forward (la 0, default stream):
    for m in pipelined_modules: m.forward.set_context(ctx)     # the PipelinedForward's context
    loss, aux = dmp(batch)                                       # DMP -> DDP -> HSTUModel
    ``self.ec(batch.sparse_features)`` hits ``PipelinedForward.__call__``, which ignores its
    argument, POPS ctx.input_dist_tensors_requests[name] (waits the tensors a2a) and
    ctx.module_contexts[name], and returns ``module.compute_and_output_dist(module_ctx, kjt)``
    (embedding lookup + output all-to-all, a LazyAwaitable the ranker waits on).
    ``PrefetchPipelinedForward`` instead POPS ctx.module_input_post_prefetch[name] and
    ctx.module_contexts_post_prefetch[name]. The set_context is what ties a forward to its
    batch: one PipelinedForward object per sharded module is shared by all batches.

backward (la 0, nccl): loss.backward()
    Output-dist backward all-to-all, fused embedding update (fbgemm applies the in-backward
    optimizer to the touched rows), DDP gradient all-reduce of the dense part (so a separate
    finalize_model_grads has nothing left to do with DDP).

optimizer_step (la 0): opt.step()   (CombinedOptimizer: dense Adam + fused no-op)

Firing (SPEC §3, L = 2, M batches): internal iteration i runs, in topo order, each task of
lookahead k on batch i - (L - k) when that is in [0, M). Per steady iteration i that is
    h2d(B[i+2]), start_input_dist(B[i+1]), wait_input_dist(B[i+1]), zero_grad, forward(B[i]),
    [prefetch_embeddings(B[i+1])], backward(B[i]), optimizer_step(B[i])
torchrec's own pipelines order the collectives differently (TrainPipelineSparseDist waits the
next batch's splits after the forward); all ranks use the same order, so results are equal.

Surprises worth knowing
-----------------------
* ``PrefetchTrainPipelineSparseDist`` and the public ``prefetch_embeddings`` do nothing without
  a data_dist stream; use ``_prefetch_embeddings`` and fill the two post-prefetch dicts.
* ``_start_data_dist`` on a version-1 context never clears it: contexts must be per batch.
* ``BaseForward`` defaults its device to ``cuda`` when no stream is given; harmless on CPU
  because ``torch.cuda.stream(None)`` is a no-op context.
* The bootstrap's input dist on B0 goes through the un-fused KJTAllToAll (one splits a2a per
  sharding group) and later batches through the fused one: both produce the same tensors.
* A table name ``items`` crashes ``EmbeddingCollection`` (``ModuleDict.items`` clash).
* ``forward`` issues a collective too: ``compute_and_output_dist`` starts the embedding
  output all-to-all (``backward`` runs its mirror). If a thread map puts ``forward`` on another
  thread than the input-dist tasks, it needs ``nccl=True`` so every rank issues the
  collectives in the same order. ``prefetch_embeddings`` only waits on an already issued one.
* ``PrefetchPipelinedForward`` keeps no fallback: if ``prefetch_embeddings`` did not run for a
  batch, its forward fails ("please do not directly call model.forward()").
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.pipeline_context import (
    PrefetchTrainPipelineContext,
    TrainPipelineContext,
)
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward, PrefetchPipelinedForward
from torchrec.distributed.train_pipeline.utils import (
    _override_input_dist_forwards,
    _prefetch_embeddings,
    _rewrite_model,
    _start_data_dist,
)

from recsys_pipe.data import Batch, DataConfig, make_dataloader
from recsys_pipe.models import HSTUConfig, HSTUModel, make_optimizer, make_sharded_model

SEED = 1234
Step = Tuple[torch.Tensor, torch.Tensor]  # (loss, sample_ids)


def build(pg: dist.ProcessGroup, device: torch.device, spec: Any, max_seq_len: int) -> Tuple[Any, Any]:
    torch.manual_seed(SEED)
    cfg = HSTUConfig(
        num_items=spec.num_items,
        num_actions=spec.num_actions,
        num_tasks=spec.num_tasks,
        num_users=spec.num_users,
        max_seq_len=max_seq_len,
    )
    model = make_sharded_model(HSTUModel(cfg), pg, device, sharding_type=os.environ.get("SHARDING", "table_wise"))
    return model, make_optimizer(model)


def run_plain(model: Any, opt: Any, batches: List[Batch], device: torch.device) -> List[Step]:
    steps = []
    for cpu_batch in batches:
        batch = cpu_batch.to(device, non_blocking=True)
        opt.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        opt.step()
        steps.append((loss.detach(), batch.sample_ids))
    return steps


def run_torchrec(model: Any, opt: Any, batches: List[Batch], device: torch.device) -> List[Step]:
    def fwd(batch: Batch) -> Tuple[torch.Tensor, Step]:
        loss, _ = model(batch)
        return loss, (loss.detach(), batch.sample_ids)

    pipeline = TrainPipelineSparseDist(model, opt, device, execute_all_batches=True, custom_model_fwd=fwd)
    it = iter(batches)
    steps = []
    while True:
        try:
            steps.append(pipeline.progress(it))
        except StopIteration:
            return steps


class HandPipeline:
    """The engine's task functions, one method each, over per-batch state dicts."""

    def __init__(self, model: Any, opt: Any, device: torch.device, prefetch: bool) -> None:
        self.model, self.opt, self.device, self.prefetch = model, opt, device, prefetch
        self.context_type = PrefetchTrainPipelineContext if prefetch else TrainPipelineContext
        self.pipelined_modules: List[Any] = []

    def bootstrap(self, state: Dict[str, Any], cpu_batch: Batch) -> None:
        self.h2d(state, cpu_batch)
        self.pipelined_modules, self.model, _, _, not_pipelined = _rewrite_model(
            model=self.model,
            context=state["context"],
            dist_stream=None,
            batch=state["batch"],
            apply_jit=False,
            pipelined_forward=PrefetchPipelinedForward if self.prefetch else PipelinedForward,
            pipeline_postproc=False,
            default_stream=None,
        )
        assert self.pipelined_modules and not not_pipelined, not_pipelined
        self.start_input_dist(state)
        _override_input_dist_forwards(self.pipelined_modules)

    def h2d(self, state: Dict[str, Any], cpu_batch: Batch) -> None:
        if "batch" in state:  # bootstrapped
            return
        state["batch"] = cpu_batch.to(self.device, non_blocking=True)
        state["context"] = self.context_type(index=state["index"], version=1)

    def start_input_dist(self, state: Dict[str, Any]) -> None:
        if state.get("dist_started"):  # bootstrapped
            return
        _start_data_dist(self.pipelined_modules, state["batch"], state["context"])
        state["dist_started"] = True

    def wait_input_dist(self, state: Dict[str, Any]) -> None:
        ctx = state["context"]
        for names, fused in ctx.fused_splits_awaitables:
            for name, request in zip(names, fused.wait()):
                ctx.input_dist_tensors_requests[name] = request
        ctx.input_dist_splits_requests.clear()
        ctx.fused_splits_awaitables.clear()

    def prefetch_embeddings(self, state: Dict[str, Any]) -> None:
        ctx = state["context"]
        data = _prefetch_embeddings(
            state["batch"], ctx, self.pipelined_modules, self.device, torch.cuda.stream, None, None
        )
        for name, dist_input in data.items():
            ctx.module_input_post_prefetch[name] = dist_input
            ctx.module_contexts_post_prefetch[name] = ctx.module_contexts.pop(name)

    def zero_grad(self, state: Dict[str, Any]) -> None:
        self.opt.zero_grad()

    def forward(self, state: Dict[str, Any]) -> None:
        for module in self.pipelined_modules:
            module.forward.set_context(state["context"])
        state["loss"], state["aux"] = self.model(state["batch"])

    def backward(self, state: Dict[str, Any]) -> None:
        state["loss"].backward()

    def optimizer_step(self, state: Dict[str, Any]) -> None:
        self.opt.step()
        state["step_result"] = (state["loss"].detach(), state["batch"].sample_ids)


def run_hand(model: Any, opt: Any, batches: List[Batch], device: torch.device, prefetch: bool) -> List[Step]:
    """Fire the tasks with the engine's rule (SPEC §3) over a list of per-batch states."""
    pipe = HandPipeline(model, opt, device, prefetch)
    tasks: List[Tuple[str, int, Callable[[Dict[str, Any]], None]]] = [
        ("h2d", 2, lambda s: pipe.h2d(s, batches[s["index"]])),
        ("start_input_dist", 1, pipe.start_input_dist),
        ("wait_input_dist", 1, pipe.wait_input_dist),
        ("zero_grad", 0, pipe.zero_grad),
        ("forward", 0, pipe.forward),
        *([("prefetch_embeddings", 1, pipe.prefetch_embeddings)] if prefetch else []),
        ("backward", 0, pipe.backward),
        ("optimizer_step", 0, pipe.optimizer_step),
    ]
    max_la = max(la for _, la, _ in tasks)
    states = [{"index": k} for k in range(len(batches))]
    pipe.bootstrap(states[0], batches[0])
    for i in range(len(batches) + max_la):
        for _, la, fn in tasks:
            k = i - (max_la - la)
            if 0 <= k < len(batches):
                fn(states[k])
    return [s.pop("step_result") for s in states]


def local_params(model: Any) -> Dict[str, torch.Tensor]:
    out = {}
    for name, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            for j, shard in enumerate(value.local_shards()):
                out[f"{name}#shard{j}"] = shard.tensor.detach().clone()
        else:
            out[name] = value.detach().clone()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    device = torch.device("cpu")
    data_cfg = DataConfig(batch_size=args.batch_size, seed=SEED, use_user_feature=True)
    loader = make_dataloader(data_cfg, rank, world)
    it: Iterator[Batch] = iter(loader)
    batches = [next(it) for _ in range(args.steps)]

    results: Dict[str, List[Step]] = {}
    params: Dict[str, Dict[str, torch.Tensor]] = {}
    timings: Dict[str, float] = {}
    runners = {
        "plain": lambda m, o: run_plain(m, o, batches, device),
        "torchrec_sdd": lambda m, o: run_torchrec(m, o, batches, device),
        "hand": lambda m, o: run_hand(m, o, batches, device, prefetch=False),
        "hand_prefetch": lambda m, o: run_hand(m, o, batches, device, prefetch=True),
    }
    initial: Dict[str, torch.Tensor] = {}
    for name, runner in runners.items():
        model, opt = build(pg, device, loader.dataset.spec, data_cfg.max_seq_len)
        initial = initial or local_params(model)
        dist.barrier()
        start = time.perf_counter()
        results[name] = runner(model, opt)
        timings[name] = time.perf_counter() - start
        params[name] = local_params(model)

    ok = True
    ref = results["plain"]
    if rank == 0:
        print("step " + " ".join(f"{n:>14}" for n in results))
        for k in range(len(ref)):
            print(f"{k:4d} " + " ".join(f"{results[n][k][0].item():14.8f}" for n in results))
    for name in results:
        assert len(results[name]) == len(ref), (name, len(results[name]))
        same_loss = all(torch.equal(a[0], b[0]) for a, b in zip(results[name], ref))
        same_ids = all(torch.equal(a[1], b[1]) for a, b in zip(results[name], ref))
        same_params = params[name].keys() == params["plain"].keys() and all(
            torch.equal(params[name][p], params["plain"][p]) for p in params["plain"]
        )
        ok &= same_loss and same_ids and same_params
        print(
            f"[rank {rank}] {name:>14}: losses bitwise={same_loss} sample_ids={same_ids} "
            f"params bitwise={same_params} ({len(params[name])} tensors) "
            f"{args.steps} steps in {timings[name]:.2f}s",
            flush=True,
        )
    # Parity must not be vacuous: every tensor (dense and each local embedding shard) trained.
    unchanged = [p for p, t in params["plain"].items() if torch.equal(t, initial[p])]
    print(f"[rank {rank}] tensors unchanged by training: {unchanged or 'none'}", flush=True)
    ok &= not unchanged
    flags = torch.tensor([int(ok)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if rank == 0:
        print("PARITY OK" if flags.item() else "PARITY FAILED", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if flags.item() else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
