"""Peak memory per rank, estimated before anything starts (`recsys-plan ... memory_gib=80`,
`recsys-train --check`), and what the estimate is made of.

The estimate adds up, for each rank, what it holds while training:

* **tables**: the shards torchrec's sharding plan puts on the rank (the plan `recsys-plan`
  prints, made on the meta device), rows x columns x the table's element size; a
  `data_parallel` table is whole on every rank;
* **table optimizer state**, by optimizer and compute kernel: on the fused kernel fbgemm's
  state for `optimizer.sparse` (sgd none, rowwise_adagrad one float per row of each shard,
  adagrad one per entry, adam two per entry); on the dense kernel the tables' gradients and the
  dense optimizer's state for them (`OptimizerConfig.state_copies` per entry);
* **dense**: the rest of the model's parameters, their gradients (DDP's buckets are views of
  them) and the dense optimizer's state;
* **activations**: what the forward keeps for the backward, per sample, times the per-rank
  batch size: measured by running the model's forward and backward on the CPU on a first
  batch of the configured data, with every table cut to at most `PROBE_ROWS` rows (a table's
  activations do not depend on its rows), counting the tensors autograd saves;
* **lookups**: the sharded lookups' own buffers: each shard's output for the samples it serves
  (the global batch: the ranks' ids come to the shard) and its gradient, plus those ids;
* **batches**: the input batches in flight, one per lookahead of the plan (`max lookahead + 1`);
* **runtime**: what a training process holds besides the model (`RUNTIME_BYTES`);
* **build** (the CPU only): every rank builds the unsharded model on the host before torchrec
  shards it (so that every layout starts from the same seeded weights,
  `recsys_pipe.models.sharding`); its tables are freed once sharded, but they are the peak of a
  CPU run while it lasts. On CUDA that memory is the host's, not the device's: a note says it.
  With `model.table_init=per_shard` the tables are built on the meta device and each rank
  draws only its shards: there is no build part. Where the build part alone makes a rank not
  fit, a note suggests that key.

The peak is the fixed part (tables, their state, dense, runtime) plus the larger of what
training adds (activations, lookups, batches) and what the build adds (CPU). How close it is:
`docs/operations/multi-node.md#memory` (measured peak RSS on 1 to 8 ranks; 64 ranks' table part
against shards built for real under torch's fake process group, `dry_run_tables`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from recsys_pipe.config import ConfigError, ConfigProblem

if TYPE_CHECKING:
    from recsys_pipe.config import CompiledPlan
    from recsys_pipe.train.config import RunConfig
    from recsys_pipe.train.parallel.topology import Topology

__all__ = [
    "PROBE_ROWS",
    "check_memory",
    "RUNTIME_BYTES",
    "MemoryEstimate",
    "RankMemory",
    "Activations",
    "device_capacity",
    "dry_run_report",
    "dry_run_tables",
    "estimate_memory",
    "probe_activations",
    "table_part",
]

GIB = 2**30
MIB = 2**20
#: what the estimate says where the unsharded build alone makes a rank not fit
PER_SHARD_NOTE = (
    "no rank would build the whole tables on the host (the build part); the initial weights then differ from the "
    "unsharded build's (docs/operations/multi-node.md#table-init)"
)
#: what is said of a layout whose memory is not estimated (`Parallelism.planned_model`)
NOT_ESTIMATED = "estimated peak memory: not estimated for how this run spreads its model over the ranks"
#: tables are cut to at most this many rows for the activation probe
PROBE_ROWS = 1024
#: what a training process holds besides the model. cpu: the peak RSS of a rank training DLRM with
#: 26 tables of 10 rows (`recsys-bench multi_host` measures it again: its "runtime" row), 1 and 2
#: ranks under gloo, 2026-12-06 on the 2-core development machine; cuda: the CUDA context and
#: NCCL's buffers, assumed (not measured here: no GPU)
RUNTIME_BYTES = {"cpu": 495 * MIB, "cuda": 1 * GIB}


@dataclass
class RankMemory:
    """One rank's estimate: bytes by part (`MemoryEstimate.columns`) and the peak."""

    rank: int
    parts: dict[str, int] = field(default_factory=dict)
    #: the part of the run that peaks: "training" or "build"
    phase: str = "training"

    def add(self, part: str, nbytes: float) -> None:
        self.parts[part] = self.parts.get(part, 0) + int(nbytes)

    @property
    def peak(self) -> int:
        return self.training_peak + max(self.parts.get(BUILD, 0) - self.training_part, 0)

    @property
    def training_peak(self) -> int:
        """The peak without the build part: the fixed parts plus what training adds."""
        return sum(v for k, v in self.parts.items() if k != BUILD)

    @property
    def training_part(self) -> int:
        """What training adds on top of the fixed parts (`TRAINING_PARTS`)."""
        return sum(self.parts.get(k, 0) for k in TRAINING_PARTS)


#: what training adds on top of the fixed parts (the build's extra memory is gone by then)
TRAINING_PARTS = ("activations", "lookups", "batches")
BUILD = "build"


@dataclass
class Activations:
    """What the probe measured: bytes autograd saved per sample, and the first batch's shape."""

    per_sample: float
    batch_bytes: int
    batch_size: int
    #: KJT feature -> ids per sample in the probed batch
    ids_per_sample: dict[str, float]


@dataclass
class MemoryEstimate:
    """The estimate for every rank of a topology, with the device's memory if known."""

    label: str
    topology: Topology
    ranks: list[RankMemory]
    capacity: int | None
    #: one line per part, saying what it counts (printed above the table)
    legend: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def columns(self) -> list[str]:
        """The parts some rank holds, in the order they were added."""
        seen: dict[str, None] = {}
        for rank in self.ranks:
            for key, value in rank.parts.items():
                if value:
                    seen.setdefault(key, None)
        return list(seen)

    @property
    def largest(self) -> RankMemory:
        """The rank with the highest peak (the lowest such rank)."""
        return max(self.ranks, key=lambda r: (r.peak, -r.rank))

    def fits(self) -> bool | None:
        """Whether the largest rank fits the capacity; None without one."""
        return None if self.capacity is None else self.largest.peak <= self.capacity

    def build_bound(self) -> bool:
        """Whether some rank does not fit only because of the build part (the unsharded tables),
        so that every rank would fit with `model.table_init=per_shard`."""
        if self.fits() is not False or not any(r.parts.get(BUILD) for r in self.ranks):
            return False
        return max(r.training_peak for r in self.ranks) <= self.capacity

    def verdict(self) -> str:
        """The one line: the largest rank, its GiB, and whether it fits."""
        top = self.largest
        head = f"estimated peak memory: largest rank {top.rank}, {top.peak / GIB:.2f} GiB"
        if self.capacity is None:
            return head + " (no per-rank memory given: not checked)"
        fits = self.fits()
        return head + f" of {self.capacity / GIB:.2f} GiB per rank: " + ("fits" if fits else "does NOT fit")

    def render(self) -> str:
        """The table, one row per rank (MiB, or GiB when a rank needs 2 GiB or more), with its
        legend and notes, ending with `verdict()`."""
        t = self.topology
        cols = self.columns
        unit, scale, digits = ("GiB", GIB, 3) if self.largest.peak >= 2 * GIB else ("MiB", MIB, 1)
        lines = [
            f"memory per rank ({self.label}; {t.world_size} rank(s), {t.hosts} host(s) x {t.local_world_size}, "
            f"{t.device_type}), {unit}:"
        ]
        lines += [f"  {line}" for line in self.legend if line.split(":")[0].strip() in cols]
        widths = [max(len(c), 8) for c in cols]
        lines.append("  " + "rank".rjust(5) + "".join(f"  {c:>{w}}" for c, w in zip(cols, widths)) + "      peak")
        for rank in self.ranks:
            cells = "".join(f"  {rank.parts.get(c, 0) / scale:>{w}.{digits}f}" for c, w in zip(cols, widths))
            flag = " (build)" if rank.phase == "build" else ""
            lines.append(f"  {rank.rank:>5}{cells}  {rank.peak / scale:>8.{digits}f}{flag}")
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(self.verdict())
        return "\n".join(lines)


def estimate_memory(
    run: RunConfig,
    plan: CompiledPlan,
    topology: Topology,
    capacity_gib: float | None = None,
    activations: Activations | None = None,
) -> MemoryEstimate | None:
    """The estimated peak memory of each rank of `topology` training `run` with `plan`
    (`activations`: measured by `probe_activations` when not given); None for a layout whose
    memory is not estimated (`Parallelism.planned_model`)."""
    from recsys_pipe.train.parallel import parallelism_of

    planned = parallelism_of(run).planned_model(topology)
    if planned is None:
        return None
    module, sharding = planned
    activations = activations or probe_activations(run)
    ranks = [RankMemory(r) for r in range(topology.world_size)]
    legend: list[str] = []
    notes: list[str] = []
    if sharding is not None:
        legend += _add_tables(run, module, sharding, topology, activations, ranks)
    legend += _add_dense(run, module, ranks)
    batch = run.data.batch_size
    in_flight = plan.graph.in_flight_batches
    legend += [
        f"activations: {activations.per_sample / 1024:.1f} KiB per sample saved for the backward (measured on the CPU"
        f" on a first batch) x {batch} per rank",
        f"batches: {in_flight} input batch(es) in flight (the plan's max lookahead + 1) x "
        f"{activations.batch_bytes / activations.batch_size * batch / MIB:.2f} MiB",
        f"runtime: {'the CUDA context and NCCL (assumed)' if topology.device_type == 'cuda' else 'the process'}",
    ]
    runtime = RUNTIME_BYTES.get(topology.device_type, RUNTIME_BYTES["cpu"])
    for rank in ranks:
        rank.add("activations", activations.per_sample * batch)
        rank.add("batches", in_flight * activations.batch_bytes / activations.batch_size * batch)
        rank.add("runtime", runtime)
    unsharded = _unsharded_table_bytes(module) if getattr(run.model, "table_init", "") == "unsharded" else 0
    if unsharded:
        if topology.device_type == "cpu":
            legend.append("build: the unsharded tables every rank builds before sharding (freed once sharded)")
            for rank in ranks:
                rank.add(BUILD, unsharded)
        else:
            notes.append(
                f"host memory while building: every rank first builds the unsharded tables on the CPU, "
                f"{unsharded / GIB:.2f} GiB per rank, {unsharded * topology.local_world_size / GIB:.2f} GiB per host "
                "(none with model.table_init=per_shard)"
            )
    for rank in ranks:
        rank.phase = "build" if rank.parts.get(BUILD, 0) > rank.training_part else "training"
    capacity = None if capacity_gib is None else int(capacity_gib * GIB)
    estimate = MemoryEstimate(run.model.label, topology, ranks, capacity, legend, notes)
    if estimate.build_bound():
        top = max(ranks, key=lambda r: r.training_peak)
        notes.append(
            f"model.table_init=per_shard would fit, rank {top.rank} at {top.training_peak / GIB:.2f} GiB: "
            f"{PER_SHARD_NOTE}"
        )
    return estimate


def _shard_ranks(sharding: Any, world_size: int) -> list[tuple[int, int, int]]:
    """(rank, rows, columns) of each shard of one table's `ParameterSharding`."""
    spec = sharding.sharding_spec
    if spec is None:  # data_parallel: whole on every rank
        return []
    return [(s.placement.rank(), s.shard_sizes[0], s.shard_sizes[1]) for s in spec.shards]


def _add_tables(
    run: RunConfig, module: Any, sharding: Any, topology: Topology, activations: Activations, ranks: list[RankMemory]
) -> list[str]:
    """Add each rank's table shards, their optimizer state and lookups; the legend lines."""
    from recsys_pipe.models.sharding import embedding_modules, table_features

    world, batch = topology.world_size, run.data.batch_size
    sparse = run.optimizer.sparse
    dense_copies = run.optimizer.state_copies
    fused_in_backward = run.model.compute_kernel == "fused"
    legend = {}
    for fqn, tables_module in embedding_modules(module).items():
        pooled = "embedding_bags." in _prefix(tables_module)
        features = table_features(tables_module)
        for table, placement in sharding.plan[fqn].items():
            weight = dict(tables_module.named_parameters())[f"{_prefix(tables_module)}{table}.weight"]
            rows, cols = weight.shape
            elem = weight.element_size()
            kernel = placement.compute_kernel
            shards = _shard_ranks(placement, world) or [(r, rows, cols) for r in range(world)]
            ids = sum(activations.ids_per_sample.get(f, 1.0) for f in features.get(table, []))
            served = batch * (1 if placement.sharding_type == "data_parallel" else world)
            for rank, shard_rows, shard_cols in shards:
                mem = ranks[rank]
                weights_key = f"tables {kernel}"
                mem.add(weights_key, shard_rows * shard_cols * elem)
                legend[weights_key] = f"{weights_key}: the shards' weights on the {kernel} kernel"
                remap = _remap_bytes(tables_module, table)
                if remap:
                    mem.add("managed remap", shard_rows * remap)
                    legend["managed remap"] = (
                        "managed remap: the managed tables' raw ids, rows and eviction counts/ages (ids=managed)"
                    )
                if kernel == "dense" and not fused_in_backward:
                    state_key = f"{run.optimizer.name} state+grads (dense)"
                    mem.add(state_key, shard_rows * shard_cols * (elem + 4 * dense_copies))
                    legend[state_key] = (
                        f"{state_key}: the dense-kernel shards' gradients and {run.optimizer.name}'s "
                        f"{dense_copies:g} state value(s) per entry"
                    )
                elif kernel == "dense":  # data_parallel tables of a fused run: torch's in-backward optimizer
                    state_key = f"{sparse.name} state+grads (dense)"
                    state = 4 * sparse.state_elements(shard_rows, shard_cols)
                    mem.add(state_key, shard_rows * shard_cols * elem + state)
                    legend[state_key] = (
                        f"{state_key}: the gradients of the dense-kernel (data_parallel) tables and the "
                        f"{sparse.name} state torch's optimizer keeps for them in backward"
                    )
                else:
                    state_key = f"{sparse.name} state ({kernel})"
                    mem.add(state_key, 4 * sparse.state_elements(shard_rows, shard_cols))
                    legend[state_key] = f"{state_key}: fbgemm's {sparse.name} state of the shards (fp32)"
                out_rows = served * (ids if not pooled else 1.0)
                mem.add("lookups", out_rows * shard_cols * elem * 2 + served * ids * 8)
    legend["lookups"] = (
        "lookups: each shard's output for the samples it serves and its gradient, and their ids "
        "(a shard serves the global batch, a data_parallel table this rank's)"
    )
    return list(legend.values())


def _prefix(tables_module: Any) -> str:
    """Where a table module keeps its tables' weights (a managed-collision module: in its table module)."""
    inner = getattr(tables_module, "_embedding_module", None)
    if inner is not None:
        return "_embedding_module." + _prefix(inner)
    return "embeddings." if hasattr(tables_module, "embedding_configs") else "embedding_bags."


def _remap_bytes(tables_module: Any, table: str) -> int:
    """Bytes per row of a managed table's remapping (torchrec's buffers: the sorted raw ids, their
    rows, and the eviction policy's counts and/or ages, int64 each); 0 for other tables."""
    collection = getattr(tables_module, "_managed_collision_collection", None)
    if collection is None:
        return 0
    policy = collection._managed_collision_modules[table]._eviction_policy
    return 8 * (2 + sum(1 for info in policy.metadata_info if info.is_mch_metadata))


def _add_dense(run: RunConfig, module: Any, ranks: list[RankMemory]) -> list[str]:
    """Add the dense parameters (every parameter outside torchrec's tables), gradients and state."""
    from recsys_pipe.models.sharding import embedding_modules

    tables = {id(p) for m in embedding_modules(module).values() for p in m.parameters()}
    params = [p for p in module.parameters() if id(p) not in tables]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    copies = run.optimizer.state_copies
    for rank in ranks:
        rank.add("dense", nbytes * (2 + copies))
    count = sum(p.numel() for p in params)
    return [
        f"dense: {count:,} parameters outside the tables, their gradients and {run.optimizer.name}'s {copies:g} "
        "state value(s) each"
    ]


def _unsharded_table_bytes(module: Any) -> int:
    from recsys_pipe.models.sharding import embedding_modules

    return sum(p.numel() * p.element_size() for m in embedding_modules(module).values() for p in m.parameters())


def probe_activations(run: RunConfig) -> Activations:
    """Run the model's forward and backward once on the CPU on the first batch of the
    configured data and count the bytes of the tensors autograd saves for the backward (each
    storage once, parameters not). A model with torchrec tables is built with every table cut to
    `PROBE_ROWS` rows, its ids folded into them on the way in (a forward pre-hook on each table
    module), so the probe needs no table memory; plain torch tables are built whole."""
    from recsys_pipe.data import make_dataloader
    from recsys_pipe.models.base import ShardedModelConfig
    from recsys_pipe.models.sharding import embedding_modules

    # one rank's share: a batch of the per-rank batch size, however few rows a share of many ranks has
    batch = next(iter(make_dataloader(run.data, 0, 1)))
    spec = run.data.spec()
    capped = dict(spec.vocab_sizes)
    if isinstance(run.model, ShardedModelConfig):
        capped = {k: min(v, PROBE_ROWS) for k, v in capped.items()}
    torch.manual_seed(run.seed)
    model = run.model.build(dataclasses.replace(spec, vocab_sizes=capped))
    ids: dict[str, float] = {}
    for tables in embedding_modules(model).values():
        tables.register_forward_pre_hook(lambda _, args: _folded(args, capped, ids, batch.batch_size))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(batch)[0]
    loss.backward()
    size = batch.batch_size
    return Activations(sum(saved.values()) / size, _batch_bytes(batch), size, ids)


def _folded(args: tuple[Any, ...], vocab: Mapping[str, int], ids: dict[str, float], batch_size: int) -> tuple[Any, ...]:
    """A table module's KJT argument with each feature's ids taken modulo its (cut) vocabulary
    size; records the ids per sample of each feature into `ids`."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = args[0]
    per_key = kjt.to_dict()
    for key, jagged in per_key.items():
        ids[key] = jagged.values().numel() / max(batch_size, 1)
    values = [jt.values() % vocab[k] if k in vocab else jt.values() for k, jt in per_key.items()]
    folded = KeyedJaggedTensor(
        keys=kjt.keys(), values=torch.cat(values), lengths=kjt.lengths(), weights=kjt.weights_or_none()
    )
    return (folded, *args[1:])


def _batch_bytes(batch: Any) -> int:
    """Bytes of a batch's tensors (its dataclass fields; a KJT's values, lengths and weights)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    total = 0
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, KeyedJaggedTensor):
            value = [value.values(), value.lengths(), value.weights_or_none()]
        for t in value if isinstance(value, list) else [value]:
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def dry_run_tables(run: RunConfig, topology: Topology, rank: int = 0) -> dict[str, int]:
    """Build `rank`'s table shards for real, alone in this process, under torch's fake process
    group of `topology.world_size` ranks (`torch.testing._internal.distributed.fake_pg`: its
    collectives return at once), and measure them: bytes of the shards' weights and of their
    fused optimizer state, as torchrec's kernels allocate them. The plan is the one made for
    `topology.device_type`, built on the CPU (a CUDA plan's placements moved to the CPU, its
    CUDA-only kernels run as `fused`: the same shards). The model is built on the meta device, so
    nothing else is allocated; the process group is destroyed again."""
    import os

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchrec.distributed import collective_utils
    from torchrec.modules.embedding_modules import EmbeddingCollection

    from recsys_pipe.models.sharding import make_sharded_model
    from recsys_pipe.train.optim import sparse_optimizer
    from recsys_pipe.train.parallel.sharded import planned_sharding

    if dist.is_initialized():
        raise RuntimeError("dry_run_tables needs a process without a process group")
    if run.data.spec().managed:
        raise ConfigError(
            ConfigProblem(
                "dry_run",
                "the dry run cannot build managed-collision tables (ids=managed): torchrec's sharded "
                "managed-collision collection gathers its shards' metadata from every rank, which torch's fake "
                "process group does not carry; the estimate (memory_gib) counts their remapping",
            )
        )
    _, plan = planned_sharding(run, run.model, topology.world_size, topology.local_world_size, topology.device_type)
    saved_env = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(topology.local_world_size)  # torchrec's host groups read it
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=topology.world_size)
    # DMP asks rank 0 by a broadcast whether to validate collectives; under the fake group a
    # broadcast carries nothing to the other ranks, so it is answered here as already asked
    validation = collective_utils._INITIALIZED
    collective_utils._INITIALIZED = True
    try:
        with torch.device("meta"):
            module = run.model.build(run.data.spec())
        if topology.world_size > 1 and any(isinstance(m, EmbeddingCollection) for m in module.modules()):
            raise ConfigError(
                ConfigProblem(
                    "dry_run",
                    f"the dry run cannot build sequence tables (torchrec's EmbeddingCollection, model "
                    f"{run.model.name!r}) at more than one rank: their sharded module gathers its shards' metadata "
                    "from every rank, which torch's fake process group does not carry; without dry_run the estimate "
                    "(memory_gib) holds, and world_size=1 builds them",
                )
            )
        optimizer, kwargs = sparse_optimizer(run.optimizer.sparse)
        sharded = make_sharded_model(
            module,
            run.model,
            dist.group.WORLD,
            torch.device("cpu"),
            batch_size=run.data.batch_size,
            embedding_optimizer=optimizer,
            embedding_optimizer_kwargs=kwargs,
            data_parallel=False,
            plan=_on_cpu(plan),
        )
        return _shard_bytes(sharded)
    finally:
        collective_utils._INITIALIZED = validation
        dist.destroy_process_group()
        if saved_env is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved_env


def _shard_bytes(sharded: torch.nn.Module) -> dict[str, int]:
    """Bytes of a sharded model's table shards as its kernels allocated them: `weights`, the
    fused optimizer's `state`, and `meta` (data_parallel tables, not materialised: by shape)."""
    from torchrec.distributed.embedding_types import ShardedEmbeddingModule

    measured = {"weights": 0, "state": 0, "meta": 0}
    # a sharded table module keeps its kernels in `_lookups`, a plain list (not a submodule),
    # whose `named_buffers` yields per-table views: each kernel module's own tensors are read
    seen: set[int] = set()
    lookups = [lk for m in sharded.modules() if isinstance(m, ShardedEmbeddingModule) for lk in m._lookups]
    for kernel in (k for lookup in lookups for k in lookup.modules()):
        for name, tensor in [*kernel._buffers.items(), *kernel._parameters.items()]:
            if tensor is None or not tensor.is_floating_point():
                continue
            if tensor.is_meta:
                measured["meta"] += tensor.numel() * tensor.element_size()
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            measured["weights" if name.startswith("weight") else "state"] += storage.nbytes()
    return measured


def _on_cpu(plan: Any) -> Any:
    """A sharding plan with every shard placed on its rank's CPU and the kernels the CPU lacks
    (fbgemm's UVM and caching kernels) replaced by `fused`."""
    from torch.distributed.remote_device import _remote_device

    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():
            if sharding.compute_kernel not in ("fused", "dense"):
                module_plan[table] = dataclasses.replace(sharding, compute_kernel="fused")
            if sharding.sharding_spec is not None:
                for shard in sharding.sharding_spec.shards:
                    shard.placement = _remote_device(f"rank:{shard.placement.rank()}/cpu")
    return plan


def device_capacity(device: torch.device, local_world_size: int) -> int:
    """Memory one rank has: its GPU's on CUDA; on the CPU the host's memory shared by its ranks."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local_world_size, 1)


def table_part(estimate: MemoryEstimate, rank: int) -> int:
    """Bytes of `rank`'s table shards and their optimizer state in `estimate` (what a dry run builds)."""
    parts = estimate.ranks[rank].parts
    return sum(v for k, v in parts.items() if k.startswith("tables ") or (" state" in k and k.endswith(")")))


def dry_run_report(estimate: MemoryEstimate, measured: Mapping[str, int], rank: int) -> str:
    """How `rank`'s tables built for real (`dry_run_tables`) compare with `estimate`'s table part."""
    expected = table_part(estimate, rank)
    built = measured["weights"] + measured["state"]
    diff = (built - expected) / expected if expected else 0.0
    t = estimate.topology
    meta = measured.get("meta", 0)
    unbuilt = f" (data_parallel tables, {meta / MIB:.2f} MiB by shape, are not built on the CPU)" if meta else ""
    return (
        f"dry run: rank {rank}'s tables built under a fake process group of {t.world_size} ranks "
        f"({t.hosts} host(s) x {t.local_world_size}): {measured['weights'] / MIB:.2f} MiB weights + "
        f"{measured['state'] / MIB:.2f} MiB optimizer state = {built / MIB:.2f} MiB; the estimate's table shards "
        f"and their state: {expected / MIB:.2f} MiB ({diff:+.1%}){unbuilt}"
    )


def check_memory(run: RunConfig, plan: CompiledPlan, device_type: str) -> tuple[str, str | None]:
    """What `recsys-train --check` says about memory for this job (`Topology.of_job`): the
    verdict line of the estimate against the memory one rank has (`device_capacity`), and a
    warning when the largest rank does not fit (None when it does)."""
    from recsys_pipe.train.parallel import Topology

    topology = Topology.of_job(device_type)
    device = torch.device("cuda" if device_type == "cuda" else "cpu")
    capacity = device_capacity(device, topology.local_world_size)
    try:
        estimate = estimate_memory(run, plan, topology, capacity / GIB)
    except Exception as exc:  # e.g. a custom model the probe cannot run on cut tables: the run itself may work
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        return f"estimated peak memory: not estimated ({type(exc).__name__}: {first})", None
    if estimate is None:
        return NOT_ESTIMATED, None
    if estimate.fits():
        return estimate.verdict(), None
    top = estimate.largest
    per_shard = f"; model.table_init=per_shard would fit: {PER_SHARD_NOTE}" if estimate.build_bound() else ""
    return estimate.verdict(), (
        f"rank {top.rank} needs an estimated {top.peak / GIB:.2f} GiB, more than the {capacity / GIB:.2f} GiB one rank "
        f"has here; `recsys-plan <the same overrides> world_size={topology.world_size} "
        f"local_world_size={topology.local_world_size} memory_gib=...` shows every rank by part{per_shard}"
    )
