"""DLRM (Naumov et al. 2019) on Criteo-format data, in two table layouts:

* `model=dlrm` / `model=dlrm_dcn`: torchrec's `torchrec.models.dlrm.DLRM` / `DLRM_DCN` (dot
  interaction / low-rank DCN cross layers) over an `EmbeddingBagCollection`, whose tables
  `DistributedModelParallel` shards (`model.sharding`). Built by `recsys_pipe.models.dlrm_torchrec`.
* `model=dlrm_torch`: the same dot-interaction architecture on plain `torch.nn.Embedding` tables,
  replicated under DDP (small vocabularies). This module and that model import no torchrec, so it
  trains where torchrec is not installed.

All of them read `batch.dense_features` and the categorical ids (`batch.sparse_features`, a KJT,
or `batch.sparse_ids` for plain tables) and score one click per row: `outputs["logits"]` and
`["labels"]` are `[B, num_tasks]`, the loss is the mean binary cross-entropy per task, summed
over tasks (the same convention as HSTU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, StrictInt, StrictStr, model_validator
from torch import nn

from recsys_pipe.config import ConfigProblem, Section, builder_field
from recsys_pipe.data.batch import CriteoBatch, DataSpec, TabularBatch
from recsys_pipe.data.source import DataConfig, TabularDataConfig
from recsys_pipe.models.base import ModelConfig, ShardedModelConfig
from recsys_pipe.models.serving import ServingForm

__all__ = [
    "DLRMArch",
    "DLRMConfig",
    "DLRMDCNConfig",
    "TabularLayout",
    "TorchDLRM",
    "TorchDLRMConfig",
    "build_dlrm_torch",
    "click_loss",
    "click_serving",
]

ModelOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]


class DLRMArch(Section):
    """Layer sizes shared by the DLRM variants."""

    embedding_dim: StrictInt = Field(16, ge=1, description="embedding width (every table)")
    dense_arch_layer_sizes: list[StrictInt] = Field(
        default_factory=lambda: [64, 16], description="dense MLP widths; the last must equal embedding_dim"
    )
    over_arch_layer_sizes: list[StrictInt] = Field(
        default_factory=lambda: [64, 32],
        description="hidden widths of the MLP over the interactions (its output layer, one logit per task, is added)",
    )

    @model_validator(mode="after")
    def _dense_arch_ends_at_embedding_dim(self) -> DLRMArch:
        if not self.dense_arch_layer_sizes or self.dense_arch_layer_sizes[-1] != self.embedding_dim:
            raise ValueError(
                f"dense_arch_layer_sizes must end with embedding_dim ({self.embedding_dim}), the width the dense "
                f"features are projected to for the interaction; got {self.dense_arch_layer_sizes}"
            )
        if any(n < 1 for n in self.dense_arch_layer_sizes + self.over_arch_layer_sizes):
            raise ValueError("layer sizes must be >= 1")
        return self

    def check_data(self, data: DataConfig) -> list[ConfigProblem]:
        if not isinstance(data, TabularDataConfig):
            return [
                ConfigProblem(
                    "data.name",
                    f"model '{self.name}' needs tabular data (criteo, criteo_synthetic, parquet, or a source whose "
                    f"config derives from recsys_pipe.data.TabularDataConfig), got '{data.label}'",
                )
            ]
        return []


class DLRMConfig(DLRMArch, ShardedModelConfig):
    """`model=dlrm`: torchrec's DLRM (dot interaction) over a sharded `EmbeddingBagCollection`."""

    name: Literal["dlrm"] = "dlrm"
    builder: StrictStr | None = builder_field("recsys_pipe.models.dlrm_torchrec:build_dlrm")


class DLRMDCNConfig(DLRMArch, ShardedModelConfig):
    """`model=dlrm_dcn`: torchrec's DLRM_DCN (low-rank cross network instead of the dot interaction)."""

    name: Literal["dlrm_dcn"] = "dlrm_dcn"
    builder: StrictStr | None = builder_field("recsys_pipe.models.dlrm_torchrec:build_dlrm_dcn")
    dcn_num_layers: StrictInt = Field(2, ge=1, description="cross layers of the interaction")
    dcn_low_rank_dim: StrictInt = Field(8, ge=1, description="rank of each cross layer's weight")


class TorchDLRMConfig(DLRMArch, ModelConfig):
    """`model=dlrm_torch`: DLRM on plain torch tables, data parallel under DDP (no torchrec)."""

    name: Literal["dlrm_torch"] = "dlrm_torch"
    builder: StrictStr | None = builder_field("recsys_pipe.models.dlrm:build_dlrm_torch")

    def check_data(self, data: DataConfig) -> list[ConfigProblem]:
        problems = super().check_data(data)
        if not problems and isinstance(data, TabularDataConfig) and data.multi_hot_features():
            problems.append(
                ConfigProblem(
                    "model.name",
                    f"dlrm_torch's plain tables take one id per row; features {data.multi_hot_features()} are "
                    "multi-hot (list columns): use model=dlrm or dlrm_dcn, whose pooled tables take them",
                )
            )
        return problems


def click_loss(logits: torch.Tensor, labels: torch.Tensor) -> ModelOutput:
    """Loss and outputs of a click model (`[B, T]` logits and labels), per the model protocol."""
    per_row = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    loss_sum = per_row.sum()
    return loss_sum / labels.shape[0], {"logits": logits.detach(), "labels": labels, "loss_sum": loss_sum}


def _mlp(sizes: list[int], final_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if final_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class TorchDLRM(nn.Module):
    """DLRM with one `nn.Embedding` per categorical feature: dense MLP, pairwise dot products of
    the F embeddings and the projected dense vector, MLP over [dense, interactions] -> logits."""

    def __init__(self, cfg: TorchDLRMConfig, spec: DataSpec) -> None:
        super().__init__()
        d = cfg.embedding_dim
        self.features = list(spec.vocab_sizes)
        self.tables = nn.ModuleList(nn.Embedding(spec.vocab_sizes[f], d) for f in self.features)
        for table in self.tables:  # torchrec's default table init: U(-1/sqrt(rows), 1/sqrt(rows))
            bound = table.num_embeddings**-0.5
            nn.init.uniform_(table.weight, -bound, bound)
        self.dense_arch = _mlp([spec.num_dense, *cfg.dense_arch_layer_sizes], final_activation=True)
        n = len(self.features) + 1
        self.register_buffer("_pairs", torch.triu_indices(n, n, offset=1), persistent=False)
        self.over_arch = _mlp(
            [d + n * (n - 1) // 2, *cfg.over_arch_layer_sizes, spec.num_tasks], final_activation=False
        )

    def dense_modules(self) -> list[nn.Module]:
        """What `trainer.compile` compiles (`DenseSubmodules`): the whole model, whose plain
        torch tables are replicated like the MLPs (torch.compile would skip a bare `nn.Sequential`)."""
        return [self]

    def forward(self, batch: CriteoBatch) -> ModelOutput:
        return click_loss(self.scores(batch.dense_features, batch.sparse_ids), batch.labels)

    def scores(self, dense_features: torch.Tensor, sparse_ids: torch.Tensor) -> torch.Tensor:
        """`[B, T]` logits of `[B, num_dense]` dense features and `[B, F]` ids (one per feature)."""
        dense = self.dense_arch(dense_features)
        vectors = torch.stack([dense, *(table(sparse_ids[:, i]) for i, table in enumerate(self.tables))], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self._pairs[0], self._pairs[1]]
        return self.over_arch(torch.cat([dense, dots], dim=1))

    def serving(self, data: DataConfig) -> ServingForm:
        """`scores(dense_features, sparse_ids)` as the serving program (`Servable`); the plain
        tables take one id per row (`TorchDLRMConfig.check_data`), in the spec's feature order."""
        return click_serving(_Scores(self), TabularLayout(tuple(self.features), ()))


class _Scores(nn.Module):
    """`TorchDLRM.scores` as a module's forward (what `torch.export` traces)."""

    def __init__(self, model: TorchDLRM) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense_features: torch.Tensor, sparse_ids: torch.Tensor) -> torch.Tensor:
        return self.model.scores(dense_features, sparse_ids)


@dataclass(frozen=True)
class TabularLayout:
    """How a click model's serving program takes the sparse features of tabular rows: the
    single-hot ones as the columns of `sparse_ids [B, len(single)]`, the multi-hot ones (list
    columns) as `list_ids [B, len(multi), L]` right-padded with `list_lengths [B, len(multi)]`."""

    single: tuple[str, ...]
    multi: tuple[str, ...]

    @classmethod
    def of(cls, features: Sequence[str], data: DataConfig) -> TabularLayout:
        """The layout of `features` (the model's order) in batches of `data`."""
        multi = set(data.multi_hot_features()) if isinstance(data, TabularDataConfig) else set()
        return cls(tuple(f for f in features if f not in multi), tuple(f for f in features if f in multi))

    def inputs(self, batch: CriteoBatch | TabularBatch) -> tuple[torch.Tensor, ...]:
        """The program's inputs for a batch of tabular rows."""
        if isinstance(batch, CriteoBatch):
            ids = batch.sparse_ids[:, [batch.keys.index(k) for k in self.single]]
            return batch.dense_features, ids
        per_key = batch.sparse_features.to_dict()
        n = batch.labels.shape[0]
        columns = [per_key[k].values().long() for k in self.single]
        ids = torch.stack(columns, dim=1) if columns else torch.zeros(n, 0, dtype=torch.int64)
        if not self.multi:
            return batch.dense_features, ids
        lengths = torch.stack([per_key[k].lengths().long() for k in self.multi], dim=1)
        longest = max(2, int(lengths.max()))  # >= 2: torch.export would take a size of 1 for a constant
        lists = torch.stack([per_key[k].to_padded_dense(longest, 0).long() for k in self.multi], dim=1)
        return batch.dense_features, ids, lists, lengths

    @property
    def input_names(self) -> tuple[str, ...]:
        return ("dense_features", "sparse_ids") + (("list_ids", "list_lengths") if self.multi else ())


def click_serving(module: nn.Module, layout: TabularLayout) -> ServingForm:
    """The serving form of a click model whose `module(dense_features, sparse_ids[, list_ids,
    list_lengths])` gives the logits (`TabularLayout`)."""
    return ServingForm(
        module=module,
        input_names=layout.input_names,
        inputs=layout.inputs,
        reference=lambda batch, outputs: outputs["logits"],
        ragged=("list_ids",) if layout.multi else (),
        program="tabular",
        slots={"sparse_ids": layout.single, "list_ids": layout.multi, "list_lengths": layout.multi},
    )


def build_dlrm_torch(cfg: TorchDLRMConfig, spec: DataSpec) -> TorchDLRM:
    """Builder of `model.name=dlrm_torch`."""
    return TorchDLRM(cfg, spec)
