"""Builders of `model=dlrm` and `model=dlrm_dcn`: torchrec's DLRM models over an
`EmbeddingBagCollection` (one table per categorical feature, `<feature>_table`; the features
with `ids: managed` in a managed-collision collection beside it, `recsys_pipe.models.managed`),
wrapped so that `forward(batch)` follows the model protocol.

torchrec's pipeline finds the collection's input by FX-tracing `DLRMRanker.forward`: the
collection is called (through `DLRM.sparse_arch`) on `batch.sparse_features`, an attribute of the
batch, so its input distribution can run ahead of the forward.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from recsys_pipe.data.batch import CriteoBatch, DataSpec
from recsys_pipe.data.source import DataConfig
from recsys_pipe.models.dlrm import (
    DLRMArch,
    DLRMConfig,
    DLRMDCNConfig,
    ModelOutput,
    TabularLayout,
    click_loss,
    click_serving,
)
from recsys_pipe.models.managed import served_tables, split_bag_collection
from recsys_pipe.models.serving import ServingForm

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

    def serving(self, data: DataConfig) -> ServingForm:
        """The serving program (`Servable`): `(dense_features [B, D], sparse_ids [B, F][, list_ids
        [B, M, L], list_lengths [B, M]]) -> [B, T]` (`TabularLayout`: the Criteo layout's 26
        features are `sparse_ids`' columns `cat_0 .. cat_25`), the tables read as plain tensors."""
        layout = TabularLayout.of(self.model.sparse_arch.sparse_feature_names, data)
        return click_serving(_DenseLookupDLRM(self.model, layout), layout)


class _DenseLookupDLRM(nn.Module):
    """torchrec's DLRM with its `EmbeddingBagCollection` replaced by plain row lookups.

    Why: a single-hot feature's sum-pooled bag of one id is that id's row, and a multi-hot
    feature's bag is the sum of its ids' rows (the collection's default pooling), so plain tensor
    indexing gives the same numbers; a program of plain tensor operations loads where neither
    torchrec nor fbgemm is installed. The dense, interaction and over arches are the trained
    modules themselves."""

    def __init__(self, model: DLRM, layout: TabularLayout) -> None:
        super().__init__()
        self.dense_arch, self.inter_arch, self.over_arch = model.dense_arch, model.inter_arch, model.over_arch
        bags = model.sparse_arch.embedding_bag_collection
        table_of = {f: c.name for c in bags.embedding_bag_configs() for f in c.feature_names}
        names = model.sparse_arch.sparse_feature_names
        #: per feature in the model's order: (is it multi-hot, its column in sparse_ids or list_ids)
        self.sources = [
            (True, layout.multi.index(n)) if n in layout.multi else (False, layout.single.index(n)) for n in names
        ]
        weights, remaps = served_tables(bags)
        self.tables = nn.ParameterList(weights[table_of[name]] for name in names)
        #: managed features (`ids: managed`) take raw ids: the program remaps them as the model did
        self.remaps = nn.ModuleList(remaps.get(name, nn.Identity()) for name in names)

    def forward(
        self,
        dense_features: torch.Tensor,
        sparse_ids: torch.Tensor,
        list_ids: torch.Tensor | None = None,
        list_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dense = self.dense_arch(dense_features)
        pooled = []
        for (multi, column), table, remap in zip(self.sources, self.tables, self.remaps):
            if multi and list_ids is not None and list_lengths is not None:
                ids = remap(list_ids[:, column])
                kept = torch.arange(ids.shape[1], device=ids.device)[None] < list_lengths[:, column, None]
                pooled.append((table[ids] * kept[..., None]).sum(dim=1))
            else:
                pooled.append(table[remap(sparse_ids[:, column])])
        return self.over_arch(self.inter_arch(dense, torch.stack(pooled, dim=1)))


def build_dlrm(cfg: DLRMConfig, spec: DataSpec) -> DLRMRanker:
    """Builder of `model.name=dlrm`."""
    return _ranker(DLRM, cfg, spec)


def build_dlrm_dcn(cfg: DLRMDCNConfig, spec: DataSpec) -> DLRMRanker:
    """Builder of `model.name=dlrm_dcn`: DLRM with torchrec's low-rank cross-net interaction."""
    return _ranker(DLRM_DCN, cfg, spec, dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim)


def _ranker(model: type[DLRM], cfg: DLRMArch, spec: DataSpec, **interaction: int) -> DLRMRanker:
    """torchrec's `model` class (DLRM or DLRM_DCN, which takes the `interaction` keywords too)
    over one table per sparse feature, sized by the data, in `DLRMRanker`."""
    return DLRMRanker(
        model(
            embedding_bag_collection=split_bag_collection(embedding_bag_tables(cfg, spec), spec.managed),
            dense_in_features=spec.num_dense,
            dense_arch_layer_sizes=list(cfg.dense_arch_layer_sizes),
            over_arch_layer_sizes=[*cfg.over_arch_layer_sizes, spec.num_tasks],
            **interaction,
        )
    )
