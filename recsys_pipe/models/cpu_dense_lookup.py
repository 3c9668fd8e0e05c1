"""The unpooled lookup of torchrec's dense kernel on CPU (`model.compute_kernel=dense` with an
`EmbeddingCollection`).

An `EmbeddingCollection` table on torchrec's dense kernel is an fbgemm
`DenseTableBatchedEmbeddingBagsCodegen` with `PoolingMode.NONE`: one output row per looked-up
id. fbgemm's CPU operator for it (`dense_embedding_codegen_lookup_function`, fbgemm-gpu-cpu 1.8)
ignores the pooling mode and sums each bag, so the output has one row per sample and torchrec's
`construct_jagged_tensors` fails. `use_unpooled_cpu_lookups` gives such modules a forward that
computes what the CUDA operator computes, with `torch.nn.functional.embedding` over the same flat
weight (fbgemm's own layout: row `hash_size_cumsum[f] + id` of the `[rows, D]` view), so the
weight is still the module's one `nn.Parameter` and gets the same dense gradient. Written here
because no library offers the unpooled CPU lookup; it is applied per module instance, by type,
and only to CPU modules in `PoolingMode.NONE`.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen
from torch import nn
from torchrec.distributed.batched_embedding_kernel import BatchedDenseEmbedding

__all__ = ["unpooled_dense_lookup", "use_unpooled_cpu_lookups"]


def unpooled_dense_lookup(
    module: DenseTableBatchedEmbeddingBagsCodegen,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    feature_requires_grad: torch.Tensor | None = None,
    batch_size_per_feature_per_rank: list[list[int]] | None = None,
) -> torch.Tensor:
    """`[len(indices), D]`: the row of every id, features in order (`offsets` holds B bags per
    feature, as the fbgemm operator takes them). Every table of an `EmbeddingCollection` has the
    same width, so the flat weight is one `[rows, D]` matrix."""
    if per_sample_weights is not None or batch_size_per_feature_per_rank is not None:
        raise NotImplementedError("unpooled CPU lookup: per-sample weights and variable batch sizes are not supported")
    num_features = module.D_offsets.numel() - 1
    bags = (offsets.numel() - 1) // num_features
    lengths = offsets[1:] - offsets[:-1]
    feature = torch.arange(num_features, device=indices.device).repeat_interleave(bags)
    rows = indices.long() + module.hash_size_cumsum[feature.repeat_interleave(lengths)]
    return F.embedding(rows, module.weights.view(-1, module.max_D))


def use_unpooled_cpu_lookups(model: nn.Module) -> int:
    """Give every CPU dense-kernel sequence table of `model` (a DMP-sharded model) the unpooled
    lookup; returns how many modules it changed. torchrec keeps a sharded collection's lookups in
    a plain list (`_lookups`), not as submodules, so they are searched there."""
    changed = 0
    for sharded in model.modules():
        for lookup in getattr(sharded, "_lookups", ()):
            for kernel in lookup.modules():
                if not isinstance(kernel, BatchedDenseEmbedding):
                    continue
                tbe = kernel.emb_module
                if tbe.use_cpu and tbe.pooling_mode == PoolingMode.NONE:
                    tbe.forward = types.MethodType(unpooled_dense_lookup, tbe)
                    changed += 1
    return changed
