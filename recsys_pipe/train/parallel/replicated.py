"""`Replicated`: a model with plain torch tables, a whole copy on every rank, its gradients
averaged by DDP: torch's, or megatron-core's with `trainer.dense_ddp=megatron`
(`recsys_pipe.train.dense_ddp`). Needs no torchrec."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.train.dense_ddp import check_dense_ddp, megatron_ddp
from recsys_pipe.train.managed import refuse_managed
from recsys_pipe.train.optim import dense_optimizer_factory
from recsys_pipe.train.parallel.base import Parallelism

if TYPE_CHECKING:
    from recsys_pipe.config import CompiledPlan
    from recsys_pipe.data.batch import DataSpec
    from recsys_pipe.runtime.distributed import DistInfo
    from recsys_pipe.train.parallel.topology import Topology
    from recsys_pipe.train.rng import RngState

__all__ = ["Replicated", "seeded_model"]


def seeded_model(run: Any, spec: DataSpec, rng: RngState) -> nn.Module:
    """The configured model built from the run's seed (the same initial weights on every rank),
    its dropout drawing from `rng`'s dropout stream."""
    torch.manual_seed(run.seed)
    module = run.model.build(spec)
    rng.attach(module)
    return module


def _has_torchrec_tables(model: nn.Module) -> bool:
    """Without importing torchrec: its table modules can only exist once torchrec loaded them."""
    tables = sys.modules.get("torchrec.modules.embedding_modules")
    if tables is None:
        return False
    kinds = (tables.EmbeddingCollection, tables.EmbeddingBagCollection)
    return any(isinstance(m, kinds) for m in model.modules())


class Replicated(Parallelism):
    """Every rank holds the whole model; DDP averages the gradients."""

    def check(self, topology: Topology) -> None:
        topology.check()
        check_dense_ddp(self.run, topology.device_type)
        refuse_managed(
            self.run.data.spec(),
            f"model '{self.run.model.label}' has plain torch tables; managed ids need torchrec's managed-collision "
            "tables: use model=dlrm or dlrm_dcn (docs/raw-ids.md)",
        )

    def build_model(self, spec: DataSpec, info: DistInfo, rng: RngState) -> tuple[nn.Module, Any]:
        run = self.run
        check_dense_ddp(run, info.device.type)  # again, for programmatic use
        module = seeded_model(run, spec, rng)
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
        return model, dense_optimizer_factory(run.optimizer)(model.parameters())

    def describe_model(self, plan: CompiledPlan, world_size: int, local_size: int, device_type: str) -> str:
        if self.run.trainer.dense_ddp == "megatron":
            return (
                f"model: {self.run.model.label} (plain torch tables, replicated on every rank under megatron-core's "
                "DDP; gradients all-reduced by finalize_model_grads)"
            )
        return f"model: {self.run.model.label} (plain torch tables, replicated on every rank under DDP)"
