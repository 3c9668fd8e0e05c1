"""Builders of `model=dlrm` and `model=dlrm_dcn`: torchrec's DLRM models over an
`EmbeddingBagCollection` (one table per categorical feature, `<feature>_table`), wrapped so that
`forward(batch)` follows the model protocol.

torchrec's pipeline finds the collection's input by FX-tracing `DLRMRanker.forward`: the
collection is called (through `DLRM.sparse_arch`) on `batch.sparse_features`, an attribute of the
batch, so its input distribution can run ahead of the forward.
"""

from __future__ import annotations

from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys_pipe.data.criteo import CriteoBatch
from recsys_pipe.data.spec import DataSpec
from recsys_pipe.models.dlrm import DLRMArch, DLRMConfig, DLRMDCNConfig, ModelOutput, click_loss

__all__ = ["DLRMRanker", "build_dlrm", "build_dlrm_dcn", "embedding_bag_tables"]


def embedding_bag_tables(cfg: DLRMArch, spec: DataSpec) -> list[EmbeddingBagConfig]:
    """One `embedding_dim`-wide table per sparse feature of the data (the interaction needs one width)."""
    return [
        EmbeddingBagConfig(
            name=f"{feature}_table", embedding_dim=cfg.embedding_dim, num_embeddings=n, feature_names=[feature]
        )
        for feature, n in spec.vocab_sizes.items()
    ]


class DLRMRanker(nn.Module):
    """A torchrec DLRM (`model`) scoring clicks: `forward(batch) -> (loss, outputs)`."""

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.model = model

    def dense_modules(self) -> list[nn.Module]:
        """What `trainer.compile` compiles (`DenseSubmodules`): torchrec's dense, interaction
        and over arches; the sparse arch is the sharded tables."""
        return [self.model.dense_arch, self.model.inter_arch, self.model.over_arch]

    def forward(self, batch: CriteoBatch) -> ModelOutput:
        logits = self.model(batch.dense_features, batch.sparse_features)
        return click_loss(logits, batch.labels)


def build_dlrm(cfg: DLRMConfig, spec: DataSpec) -> DLRMRanker:
    """Builder of `model.name=dlrm`."""
    return DLRMRanker(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=embedding_bag_tables(cfg, spec)),
            dense_in_features=spec.num_dense,
            dense_arch_layer_sizes=list(cfg.dense_arch_layer_sizes),
            over_arch_layer_sizes=[*cfg.over_arch_layer_sizes, spec.num_tasks],
        )
    )


def build_dlrm_dcn(cfg: DLRMDCNConfig, spec: DataSpec) -> DLRMRanker:
    """Builder of `model.name=dlrm_dcn`."""
    return DLRMRanker(
        DLRM_DCN(
            embedding_bag_collection=EmbeddingBagCollection(tables=embedding_bag_tables(cfg, spec)),
            dense_in_features=spec.num_dense,
            dense_arch_layer_sizes=list(cfg.dense_arch_layer_sizes),
            over_arch_layer_sizes=[*cfg.over_arch_layer_sizes, spec.num_tasks],
            dcn_num_layers=cfg.dcn_num_layers,
            dcn_low_rank_dim=cfg.dcn_low_rank_dim,
        )
    )
