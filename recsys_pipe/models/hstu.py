"""HSTU ranking model (Hierarchical Sequential Transduction Units, Zhai et al. 2024).

Layout, chosen for torchrec's sparse-dist pipeline:

* `HSTUModel` holds the `EmbeddingCollection` as the direct attribute `ec` and its
  `forward(batch)` is two calls: `self.ec(batch.sparse_features)` and the dense
  `HSTURanker`. `_rewrite_model` FX-traces that forward with the ranker as a leaf
  (it holds no sharded module), finds the `ec` call whose argument is the `getattr` chain
  `batch.sparse_features`, and can then run the EC's input_dist ahead of the forward.
  Anything data-dependent lives inside the ranker, which FX never traces. With `ids: managed`
  items (and users) `ec` is a `SplitCollection` (`recsys_pipe.models.managed`): the action
  table and the managed-collision tables, each called on that same argument.
* The ranker works on jagged token values `[T, D]`: LayerNorm, projections and the output
  MLP never see padding. The attention (`model.attention`) either pads to `[B, N, ...]` and
  back with fbgemm's `jagged_to_padded_dense` / `dense_to_jagged` (`padded`), or runs fused
  Triton kernels on the jagged tokens (`triton`, `recsys_pipe.models.hstu_triton`; `auto`
  picks it on CUDA). Both compute the same function.

Sequence of a sample: `[user?] history_1 .. history_h candidate_1 .. candidate_c`; a token is
`item_emb + action_emb` (candidates carry the masked action, so their label stays hidden).
Attention is causal, and a candidate is visible only to itself, so candidates are scored
independently of each other. The multi-task head reads the candidate tokens of the last layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.types import Awaitable
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor

from recsys_pipe.data.batch import ACTION_KEY, ITEM_KEY, MASKED_ACTION, USER_KEY, DataSpec, SequenceBatch
from recsys_pipe.data.source import DataConfig
from recsys_pipe.models.dropout import Dropout
from recsys_pipe.models.hstu_attention import (
    MaskStatics,
    RelativeBias,
    SummedBackwardLookup,
    attention_mask,
    bias_lookup,
    padded_attention,
    triton_available,
    uses_triton,
)
from recsys_pipe.models.hstu_config import HSTUConfig
from recsys_pipe.models.managed import served_tables, split_collection
from recsys_pipe.models.serving import ServingForm

if TYPE_CHECKING:
    from recsys_pipe.models.hstu_triton import JaggedBias

__all__ = [
    "HSTUConfig",
    "HSTULayer",
    "HSTUModel",
    "HSTURanker",
    "RelativeBias",
    "SummedBackwardLookup",
    "attention_mask",
    "bias_lookup",
    "build_hstu",
    "candidate_rows",
    "embedding_tables",
    "prepend_context",
    "triton_available",
    "uses_triton",
]

ModelOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]
LAYER_NORM_EPS = 1e-6
"""LayerNorm epsilon of the HSTU blocks (generative-recommenders')."""


def build_hstu(cfg: HSTUConfig, spec: DataSpec) -> HSTUModel:
    """Builder of `model.name=hstu`."""
    return HSTUModel(cfg, spec)


def _has_user(spec: DataSpec) -> bool:
    return USER_KEY in spec.vocab_sizes


def padded_len(cfg: HSTUConfig, spec: DataSpec) -> int:
    """Attention length N: item tokens plus the contextual user token, if the data has one."""
    return cfg.max_seq_len + (1 if _has_user(spec) else 0)


def embedding_tables(cfg: HSTUConfig, spec: DataSpec) -> list[EmbeddingConfig]:
    """One table per feature, named `<feature>_table` (`items` would shadow
    `ModuleDict.items`); all share `embedding_dim` (a sharded EC requires it)."""
    features = [ITEM_KEY, ACTION_KEY] + ([USER_KEY] if _has_user(spec) else [])
    return [
        EmbeddingConfig(
            name=f"{feature}_table",
            embedding_dim=cfg.embedding_dim,
            num_embeddings=spec.vocab_sizes[feature],
            feature_names=[feature],
        )
        for feature in features
    ]


class HSTULayer(nn.Module):
    """One HSTU block on jagged tokens (the paper's equations 1-3, as generative-recommenders'
    `SequentialTransductionUnitJagged` with `rel_bias` normalisation):

        u, v, q, k = split(SiLU(LayerNorm(x) @ W_uvqk))
        A = SiLU(q k^T + bias) / N * mask          (per head; N the padded length)
        x = x + W_o Dropout(u * LayerNorm(A v)) + b_o

    LayerNorms without learned scale or shift, epsilon 1e-6."""

    def __init__(self, cfg: HSTUConfig, max_len: int) -> None:
        super().__init__()
        d = cfg.embedding_dim
        self.num_heads = cfg.num_heads
        self.max_len = max_len
        # the paper's Norm: LayerNorm without learned scale and shift (the reference's F.layer_norm)
        self.input_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS, elementwise_affine=False)
        self.uvqk = nn.Linear(d, 4 * d, bias=False)  # the paper's f1: one projection, no bias
        self.attn_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS, elementwise_affine=False)
        self.output = nn.Linear(d, d)
        self.dropout = Dropout(cfg.dropout)
        nn.init.normal_(self.uvqk.weight, 0.0, 0.02)  # the reference's initialisation
        nn.init.xavier_uniform_(self.output.weight)

    def forward(
        self, x: torch.Tensor, offsets: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`x` jagged `[T, D]`; `mask`/`bias` `[B, N, N]` -> jagged `[T, D]` (`model.attention=padded`:
        the attention pads to `[B, N, ...]` and back)."""

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qkv = torch.cat([q, k, v], dim=-1)
            padded = torch.ops.fbgemm.jagged_to_padded_dense(qkv, [offsets], [self.max_len], 0.0)
            # the token count from the host-known shape: without it fbgemm reads offsets[-1] (a host sync on CUDA)
            return torch.ops.fbgemm.dense_to_jagged(self._attend(padded, mask, bias), [offsets], q.shape[0])[0]

        return self._block(x, attend)

    def forward_jagged(
        self, x: torch.Tensor, offsets: torch.Tensor, num_candidates: torch.Tensor | None, bias: JaggedBias | None
    ) -> torch.Tensor:
        """The same block with the fused Triton attention on the jagged tokens (`model.attention=
        triton`, `recsys_pipe.models.hstu_triton`): nothing is padded; the trailing
        `num_candidates` `[B]` tokens of each sequence are its candidates, `bias` the relative
        bias's tables and jagged timestamps (`RelativeBias.jagged`)."""
        from recsys_pipe.models.hstu_triton import jagged_hstu_attention

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            t, h = q.shape[0], self.num_heads
            heads = (q.view(t, h, -1), k.view(t, h, -1), v.view(t, h, -1))
            return jagged_hstu_attention(*heads, offsets, self.max_len, num_candidates, bias).view(t, -1)

        return self._block(x, attend)

    def forward_padded(self, x: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The same block on padded tokens `[B, N, D]` (the serving program's layout, which needs
        no fbgemm): every token-wise step is the same, and the mask keeps padding keys out of
        the attention, so the valid positions equal `forward`'s; padding positions are junk."""
        return self._block(x, lambda q, k, v: self._attend(torch.cat([q, k, v], dim=-1), mask, bias))

    def _block(self, x: torch.Tensor, attend: Any) -> torch.Tensor:
        """Everything around the attention: `attend(q, k, v)` on the projected tokens."""
        u, v, q, k = F.silu(self.uvqk(self.input_norm(x))).chunk(4, dim=-1)
        return x + self.output(self.dropout(u * self.attn_norm(attend(q, k, v))))

    def _attend(self, qkv: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Padded `[B, N, 3D]` queries, keys, values -> the attention output `[B, N, D]`."""
        return padded_attention(qkv, mask, bias, self.num_heads)


class HSTURanker(nn.Module):
    """Everything after the embedding lookup: sequence assembly, HSTU stack, multi-task head.

    Kept as one module so the FX trace of `HSTUModel` treats it as a leaf.
    """

    def __init__(self, cfg: HSTUConfig, spec: DataSpec) -> None:
        super().__init__()
        d = cfg.embedding_dim
        self.padded_len = padded_len(cfg, spec)
        self.with_user = _has_user(spec)
        #: `model.attention`: auto, padded or triton (`uses_triton` decides per call, by device)
        self.attention = cfg.attention
        self.input_dropout = Dropout(cfg.dropout)
        self.bias = RelativeBias(self.padded_len, cfg.num_time_buckets) if cfg.relative_bias else None
        self.mask_statics = MaskStatics(self.padded_len)
        self.layers = nn.ModuleList(HSTULayer(cfg, self.padded_len) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(d)
        self.head = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, spec.num_tasks))

    def forward(
        self,
        embeddings: dict[str, JaggedTensor],
        timestamps: torch.Tensor,
        num_candidates: torch.Tensor,
        labels: torch.Tensor,
    ) -> ModelOutput:
        if isinstance(embeddings, Awaitable):  # sharded EC output is lazy
            embeddings = embeddings.wait()
        items, actions = embeddings[ITEM_KEY], embeddings[ACTION_KEY]
        tokens = items.values() + actions.values()
        lengths = items.lengths().long()
        if self.with_user:
            tokens, timestamps, lengths = prepend_context(tokens, timestamps, lengths, embeddings[USER_KEY])
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        if uses_triton(self.attention, tokens.device):
            jagged_bias = self.bias.jagged(timestamps) if self.bias is not None else None
            x = self.input_dropout(tokens)
            for layer in self.layers:
                x = layer.forward_jagged(x, offsets, num_candidates, jagged_bias)
        else:
            mask = attention_mask(lengths, num_candidates, self.padded_len, self.mask_statics)
            bias = None
            if self.bias is not None:
                padded_ts = torch.ops.fbgemm.jagged_1d_to_dense(timestamps, offsets, self.padded_len, 0)
                bias = self.bias(padded_ts)
            x = self.input_dropout(tokens)
            for layer in self.layers:
                x = layer(x, offsets, mask, bias)
        rows = candidate_rows(offsets, num_candidates, labels.shape[0])
        logits = self.head(self.final_norm(x)[rows])
        per_token = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        task_losses = per_token.mean(dim=0)
        aux = {
            "logits": logits.detach(),
            "labels": labels,
            "loss_sum": per_token.sum(),
            "task_losses": task_losses.detach(),
            # a device fill, not torch.tensor(..., device=...): that copies from the host and waits for it on CUDA
            "num_candidates": torch.full((), labels.shape[0], dtype=torch.int64, device=logits.device),
            "num_tokens": offsets[-1].detach(),
        }
        return task_losses.sum(), aux


class HSTUModel(nn.Module):
    """EmbeddingCollection (`ec`, sharded by DMP) + `HSTURanker` (`ranker`, dense/DDP).

    `forward(batch) -> (loss, aux)`: loss is the sum over tasks of the mean BCE over the
    batch's candidates; `aux` has `logits`/`labels` `[C, num_tasks]` for metrics, `loss_sum`
    (the BCE summed over candidates and tasks, for global-token normalisation), per-task losses
    and the candidate/token counts.
    """

    def __init__(self, cfg: HSTUConfig, spec: DataSpec, device: torch.device | None = None) -> None:
        super().__init__()
        self.ec = split_collection(embedding_tables(cfg, spec), spec.managed, device=device)
        self.ranker = HSTURanker(cfg, spec)

    def dense_modules(self) -> list[nn.Module]:
        """What `trainer.compile` compiles: the ranker (`DenseSubmodules`)."""
        return [self.ranker]

    def forward(self, batch: SequenceBatch) -> ModelOutput:
        embeddings = self.ec(batch.sparse_features)
        return self.ranker(embeddings, batch.timestamps, batch.num_candidates, batch.labels)

    def serving(self, data: DataConfig) -> ServingForm:
        """The serving program (`Servable`): `(items, actions, timestamps, lengths,
        num_candidates[, users]) -> logits [B, L, num_tasks]`.

        Each sample is one row of `[B, L]` tensors (`L` = `model.max_seq_len`, the attention
        length the model was trained with), right-padded: its history, then its candidates, as a
        training batch holds them; `lengths [B]` counts both, `num_candidates [B]` the trailing
        candidates (their actions are ignored: the model sees the masked action there), `users
        [B]` is there when the data has a user feature. `logits[b, j]` scores candidate `j` of
        sample `b`; rows from `num_candidates[b]` on are zero. Padded tensors rather than jagged
        ones: every shape but the batch is static, so the program needs neither fbgemm nor
        data-dependent sizes."""
        ranker = self.ranker
        length = ranker.padded_len - (1 if ranker.with_user else 0)

        def inputs(batch: SequenceBatch) -> tuple[torch.Tensor, ...]:
            kjt = batch.sparse_features
            items, actions = kjt[ITEM_KEY], kjt[ACTION_KEY]
            lengths = items.lengths().long()
            ts = JaggedTensor(values=batch.timestamps, lengths=items.lengths())
            padded = [jt.to_padded_dense(length, 0).long() for jt in (items, actions, ts)]
            users = (kjt[USER_KEY].values().long(),) if ranker.with_user else ()
            return (*padded, lengths, batch.num_candidates.long(), *users)

        def reference(batch: SequenceBatch, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
            logits, counts = outputs["logits"], batch.num_candidates.long()
            sample = torch.repeat_interleave(torch.arange(counts.numel()), counts)
            within = torch.arange(logits.shape[0]) - torch.ops.fbgemm.asynchronous_complete_cumsum(counts)[sample]
            scores = logits.new_zeros(counts.numel(), length, logits.shape[1])
            scores[sample, within] = logits
            return scores

        names = ("items", "actions", "timestamps", "lengths", "num_candidates")
        return ServingForm(
            module=_CandidateScores(self, length),
            input_names=names + (("users",) if ranker.with_user else ()),
            inputs=inputs,
            reference=reference,
            output=f"logits [B, {length}, num_tasks]: [b, j] scores candidate j of sample b, zero from "
            "num_candidates[b] on",
            program="sequence_ranking",
            slots={"items": ("item",), "actions": ("action",), "timestamps": ("timestamp",), "users": ("user",)},
            params={"max_seq_len": length},
        )


class _CandidateScores(nn.Module):
    """`HSTUModel`'s forward on padded `[B, L]` tensors (`HSTUModel.serving`): plain tensor
    lookups in the trained tables (no torchrec), the ranker's blocks on padded tokens
    (`HSTULayer.forward_padded`), the head on the candidate positions."""

    def __init__(self, model: HSTUModel, length: int) -> None:
        super().__init__()
        tables, remaps = served_tables(model.ec)
        self.items = tables[f"{ITEM_KEY}_table"]
        self.actions = tables[f"{ACTION_KEY}_table"]
        self.users = tables[f"{USER_KEY}_table"] if model.ranker.with_user else None
        #: managed items and users (`ids: managed`) come as raw ids: the program remaps them
        self.item_rows = remaps.get(ITEM_KEY, nn.Identity())
        self.user_rows = remaps.get(USER_KEY, nn.Identity())
        self.ranker = model.ranker
        self.length = length

    def forward(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        timestamps: torch.Tensor,
        lengths: torch.Tensor,
        num_candidates: torch.Tensor,
        users: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ranker = self.ranker
        pos = torch.arange(self.length, device=items.device)
        candidate = pos[None] >= (lengths - num_candidates)[:, None]
        actions = torch.where(candidate, MASKED_ACTION, actions)
        tokens = self.items[self.item_rows(items)] + self.actions[actions]
        if self.users is not None and users is not None:  # `prepend_context`: at the first item's time
            tokens = torch.cat([self.users[self.user_rows(users)][:, None], tokens], dim=1)
            timestamps = torch.cat([timestamps[:, :1], timestamps], dim=1)
            lengths = lengths + 1
        mask = attention_mask(lengths, num_candidates, ranker.padded_len, ranker.mask_statics)
        bias = ranker.bias(timestamps) if ranker.bias is not None else None
        x = ranker.input_dropout(tokens)
        for layer in ranker.layers:
            x = layer.forward_padded(x, mask, bias)
        rows = (lengths - num_candidates)[:, None] + pos[None]  # candidate j of each sample
        rows = rows.clamp(max=ranker.padded_len - 1)
        picked = torch.gather(x, 1, rows[..., None].expand(-1, -1, x.shape[-1]))
        logits = ranker.head(ranker.final_norm(picked))
        return torch.where((pos[None] < num_candidates[:, None])[..., None], logits, 0.0)


def prepend_context(
    tokens: torch.Tensor, timestamps: torch.Tensor, lengths: torch.Tensor, context: JaggedTensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Put each sample's contextual tokens before its item tokens (jagged concat per sample).

    Contextual tokens take the sample's first item timestamp, so they sit at time gap 0.
    """
    ctx_lengths = context.lengths().long()
    ctx_offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(ctx_lengths)
    item_offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    total = ctx_lengths + lengths
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(total)
    num_ctx, num_total = context.values().shape[0], context.values().shape[0] + tokens.shape[0]
    sample = torch.repeat_interleave(torch.arange(total.numel(), device=total.device), total, output_size=num_total)
    local = torch.arange(num_total, device=total.device) - offsets[sample]
    is_ctx = local < ctx_lengths[sample]
    index = torch.where(
        is_ctx, ctx_offsets[sample] + local, num_ctx + item_offsets[sample] + local - ctx_lengths[sample]
    )
    merged = torch.cat([context.values(), tokens])[index]
    first_ts = timestamps[item_offsets[:-1]].repeat_interleave(ctx_lengths, output_size=num_ctx)
    merged_ts = torch.cat([first_ts, timestamps])[index]
    return merged, merged_ts, total


def candidate_rows(offsets: torch.Tensor, num_candidates: torch.Tensor, total: int) -> torch.Tensor:
    """Jagged row indices of the `total` candidate tokens (the last `num_candidates[b]` of
    sample b). Sizes come from host-known shapes, so no device sync on CUDA."""
    device = offsets.device
    sample = torch.repeat_interleave(
        torch.arange(num_candidates.numel(), device=device), num_candidates, output_size=total
    )
    cand_offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(num_candidates)
    within = torch.arange(total, device=device) - cand_offsets[sample]
    return offsets[sample + 1] - num_candidates[sample] + within
