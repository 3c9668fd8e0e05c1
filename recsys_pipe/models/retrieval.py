"""Next-item retrieval models: an item table, a causal sequence encoder, and the two losses.

Layout (as `recsys_pipe.models.hstu`, for torchrec's sparse-dist pipeline): `RetrievalModel`
holds the item table as the torchrec `EmbeddingCollection` `ec` (sharded by DMP like the ranking
model's) and its forward is two calls, `self.ec(batch.sparse_features)` and the dense
`RetrievalHead`, which FX treats as a leaf. Every item lookup of a batch (inputs, targets,
negatives, evaluation candidates, the catalogue) is a feature of that one KJT sharing the one
table, so all of them are input-distributed ahead of the forward by any plan.

The encoder (`SASRecEncoder` or `HSTUEncoder`) maps a batch's input sequences to one vector per
position; the vector at position t scores item `i` by the dot product with `i`'s embedding and
is trained to score `s_{t+1}` highest:

* `bce` (SASRec): per position, binary cross-entropy of the target (label 1) and of one sampled
  negative (label 0), averaged over positions.
* `sampled_softmax` (HSTU): per position, softmax cross-entropy of the target against
  `num_negatives` negatives, on L2-normalised vectors (norms clamped at 1e-6) divided by
  `temperature`; a negative equal to the target is masked out. Whose negatives
  (`model.negatives`): `per_position` (the default, generative-recommenders' recipe), each
  position its own `num_negatives`, which the data draws (`negatives_per_target`, derived from
  the model config: `neg` holds the batch's distinct negatives, each looked up and normalised
  once, and `RetrievalBatch.neg_index` each position's own, scored by `gathered_scores`);
  `shared`, one pool for every position of the batch, the first `num_negatives` of its
  negatives (the data draws one per target): K lookups per batch instead of K per position.

With `data.ids=managed` the item table is a managed-collision table (`split_collection`) and
every id of the KJT is a raw id: only the inputs and targets are counted for eviction
(`DataSpec.managed`'s `counted`), and the held-out item's full-corpus column is found by its raw
id in the catalogue. Ties (items without a row of their own share one) rank against the held-out
item (docs/raw-ids.md#retrieval-models).

Evaluation (the model in eval mode, batches of an evaluation split): the last position's vector
scores the held-out item and its sampled negatives (`cand`) and, when the batch carries it, every
item of the catalogue. `outputs["rank_sampled"]` / `outputs["rank_full"]` (`[B]`) are the 0-based
rank of the held-out item: the number of candidates scored strictly above it. Full-corpus ranking
scores every item, the user's own history included (generative-recommenders' own evaluation
removes the history from its top-k; docs/retrieval.md); -1 when the batch has no catalogue.
"""

from __future__ import annotations

from collections.abc import Callable

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.types import Awaitable
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from recsys_pipe.data.batch import (
    CAND_KEY,
    CATALOG_KEY,
    INPUT_KEY,
    NEG_KEY,
    POS_KEY,
    RETRIEVAL_KEYS,
    DataSpec,
    RetrievalBatch,
)
from recsys_pipe.data.source import DataConfig
from recsys_pipe.models.managed import served_tables, split_collection
from recsys_pipe.models.retrieval_config import RetrievalConfig
from recsys_pipe.models.serving import ServingForm

__all__ = [
    "ITEM_TABLE",
    "RetrievalConfig",
    "RetrievalHead",
    "RetrievalModel",
    "gathered_scores",
    "left_pad",
    "padded_times",
]

ModelOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]
ITEM_TABLE = "item_table"
NORM_EPS = 1e-6
"""Clamp of the L2 norms of the sampled softmax's vectors."""


def table_dim(embedding_dim: int) -> int:
    """Width of the item table: fbgemm's kernels need a multiple of 4, so a width such as SASRec's
    50 gets a table of 52 columns of which the model reads the first 50 (the others never get a
    gradient, so the model is exactly a 50-wide one)."""
    return -(-embedding_dim // 4) * 4


def item_table(cfg: RetrievalConfig, spec: DataSpec) -> EmbeddingConfig:
    """The one item table, looked up by every feature of a retrieval batch, initialised as the
    model's reference code does (`RetrievalConfig.item_init`)."""
    num_items = spec.vocab_sizes[INPUT_KEY]
    std, truncated = cfg.item_init(num_items)

    def init(weight: torch.Tensor) -> torch.Tensor:
        if truncated:
            return nn.init.trunc_normal_(weight, 0.0, std, -2 * std, 2 * std)
        return nn.init.normal_(weight, 0.0, std)

    return EmbeddingConfig(
        name=ITEM_TABLE,
        embedding_dim=table_dim(cfg.embedding_dim),
        num_embeddings=num_items,
        feature_names=list(RETRIEVAL_KEYS),
        init_fn=init,
    )


def padded_times(
    timestamps: torch.Tensor, target_timestamps: torch.Tensor, lengths: torch.Tensor, n: int
) -> torch.Tensor:
    """The encoders' `[B, n + 1]` times: the input items' (jagged `timestamps`) left-padded to n
    as the items are, then each sample's `target_timestamps` (the time of the item after its
    last input), so column p + 1 is the time of the item position p predicts."""
    ts, _ = left_pad(timestamps, lengths, n)
    return torch.cat([ts, target_timestamps.to(ts.dtype)[:, None]], dim=1)


def left_pad(values: torch.Tensor, lengths: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged rows `[T, ...]` -> `[B, n, ...]` with each sequence's last row at position n - 1
    (SASRec's left padding), and the `[B, n]` mask of real rows. Sequences longer than n keep
    their last n rows."""
    lengths = lengths.long()
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    b = lengths.numel()
    pos = torch.arange(n, device=values.device)
    valid = pos[None, :] >= (n - lengths.clamp(max=n))[:, None]
    src = offsets[1:, None] - n + pos[None, :]  # row of position p of sample b: its end - (n - p)
    out = values.new_zeros((b, n, *values.shape[1:]))
    out[valid] = values[src[valid]]
    return out, valid


class RetrievalHead(nn.Module):
    """Everything after the item lookup: encoder, loss, evaluation ranks (an FX leaf)."""

    def __init__(
        self, cfg: RetrievalConfig, encoder: Callable[[RetrievalConfig], nn.Module], raw_ids: bool = False
    ) -> None:
        super().__init__()
        #: the batches carry raw item ids (`data.ids=managed`): the catalogue's are not its positions
        self.raw_ids = raw_ids
        self.max_len = cfg.max_seq_len
        self.dim = cfg.embedding_dim
        self.loss = cfg.loss
        self.num_negatives = cfg.num_negatives
        self.per_position = cfg.per_position_negatives
        self.temperature = cfg.temperature
        self.encoder = encoder(cfg)

    def forward(
        self,
        embeddings: dict[str, JaggedTensor],
        ids: KeyedJaggedTensor,
        timestamps: torch.Tensor,
        target_timestamps: torch.Tensor,
        neg_index: torch.Tensor,
    ) -> ModelOutput:
        """`embeddings`: the EC's output for `ids`, the batch's KJT (whose ids mask collisions
        of negatives with targets and pick the held-out item's full-corpus score);
        `neg_index`: `RetrievalBatch.neg_index` (where each position's negatives are in `neg`)."""
        if isinstance(embeddings, Awaitable):  # sharded EC output is lazy
            embeddings = embeddings.wait()
        lengths = embeddings[INPUT_KEY].lengths().long()
        rows = {key: jt.values()[:, : self.dim] for key, jt in embeddings.items()}  # see table_dim
        x, valid = left_pad(rows[INPUT_KEY], lengths, self.max_len)
        ts = padded_times(timestamps, target_timestamps, lengths, self.max_len)
        h = self.encoder(x, ts, valid)  # [B, N, D]
        if self.training or rows[CAND_KEY].numel() == 0:
            return self._train_loss(h, valid, rows, ids, neg_index)
        return self._rank(h, rows, ids)

    def _normalise(self, v: torch.Tensor) -> torch.Tensor:
        """Unit vectors for the sampled softmax (norm clamped at 1e-6, as generative-recommenders')."""
        return F.normalize(v, dim=-1, eps=NORM_EPS) if self.loss == "sampled_softmax" else v

    def _train_loss(
        self,
        h: torch.Tensor,
        valid: torch.Tensor,
        rows: dict[str, torch.Tensor],
        ids: KeyedJaggedTensor,
        neg_index: torch.Tensor,
    ) -> ModelOutput:
        # the targets are aligned with the inputs: position p's target is pos[p]
        query = h[valid]  # [T, D] in jagged order (sequences are never longer than max_len here)
        pos = rows[POS_KEY]
        if self.loss == "bce":
            neg = rows[NEG_KEY]
            pos_logits = (query * pos).sum(-1)
            neg_logits = (query * neg).sum(-1)
            per_token = F.binary_cross_entropy_with_logits(
                pos_logits, torch.ones_like(pos_logits), reduction="none"
            ) + F.binary_cross_entropy_with_logits(neg_logits, torch.zeros_like(neg_logits), reduction="none")
        else:
            q, p = self._normalise(query), self._normalise(pos)
            pos_logits = (q * p).sum(-1) / self.temperature
            neg_ids, target_ids = feature_ids(ids, NEG_KEY), feature_ids(ids, POS_KEY)
            if self.per_position:  # [T, K]: position t's own negatives, target by target
                t, k = q.shape[0], self.num_negatives
                if not neg_index.numel():  # one per target: `neg` is the positions' own
                    neg_index = torch.arange(neg_ids.numel(), device=neg_ids.device)
                if neg_index.numel() != t * k:
                    raise ValueError(
                        f"model.negatives=per_position needs {k} negatives per target, but the batch has "
                        f"{neg_index.numel()} for {t} targets: its data source must draw "
                        "`negatives_per_target` of its config (ModelConfig.data_for_model)"
                    )
                index = neg_index.view(t, k)
                # each distinct negative normalised once, scored by every position that drew it
                neg_scores = gathered_scores(q, self._normalise(rows[NEG_KEY]), index) / self.temperature
                same = target_ids[:, None] == neg_ids[index]
            else:  # [T, K]: one pool, the batch's first K negatives, for every position
                pool = self._normalise(rows[NEG_KEY][: self.num_negatives])
                neg_scores = q @ pool.T / self.temperature
                same = target_ids[:, None] == neg_ids[None, : pool.shape[0]]
            neg_scores = neg_scores.masked_fill(same, float("-inf"))
            neg_logits = neg_scores[:, 0]
            per_token = torch.logsumexp(torch.cat([pos_logits[:, None], neg_scores], dim=1), dim=1) - pos_logits
        count = per_token.shape[0]
        loss = per_token.sum() / max(count, 1)
        logits = torch.cat([pos_logits, neg_logits]).detach()[:, None]
        labels = torch.cat([torch.ones_like(pos_logits), torch.zeros_like(neg_logits)])[:, None]
        return loss, {
            "logits": logits,
            "labels": labels,
            "loss_sum": per_token.sum(),
            "num_tokens": torch.tensor(count, device=h.device),
        }

    def _rank(self, h: torch.Tensor, rows: dict[str, torch.Tensor], ids: KeyedJaggedTensor) -> ModelOutput:
        query = self._normalise(h[:, -1])  # [B, D]: the last position (left padding)
        b = query.shape[0]
        cand = self._normalise(rows[CAND_KEY]).view(b, -1, query.shape[-1])
        scores = torch.einsum("bd,bcd->bc", query, cand)  # [B, 1 + negatives], held-out item first
        # int32 sums: counting a bool matrix into int64 is twice as slow on the CPU
        # raw ids (`data.ids=managed`): items without a row of their own share a row, so their
        # scores tie; a held-out item ranks below every other item it ties with (docs/raw-ids.md)
        above = torch.ge if self.raw_ids else torch.gt
        rank_sampled = above(scores[:, 1:], scores[:, :1]).sum(dim=1, dtype=torch.int32).long()
        catalog = rows[CATALOG_KEY]
        if catalog.numel():
            full = query @ self._normalise(catalog).T  # [B, num_items]
            held = feature_ids(ids, CAND_KEY).view(b, -1)[:, :1]
            if self.raw_ids:  # raw ids: the held-out item's column is where the catalogue holds its id
                held = (feature_ids(ids, CATALOG_KEY)[None, :] == held).to(torch.int32).argmax(dim=1, keepdim=True)
            held_out = full.gather(1, held)
            rank_full = above(full, held_out).sum(dim=1, dtype=torch.int32).long() - int(self.raw_ids)  # not itself
        else:
            rank_full = torch.full_like(rank_sampled, -1)
        labels = torch.zeros_like(scores)
        labels[:, 0] = 1
        loss = torch.zeros((), device=h.device)
        return loss, {
            "logits": scores.detach().reshape(-1, 1),
            "labels": labels.reshape(-1, 1),
            "loss_sum": loss,
            "rank_sampled": rank_sampled,
            "rank_full": rank_full,
        }


#: positions per chunk of `gathered_scores`: on the CPU their `[positions, K, D]` rows stay in the
#: cache; on a GPU a chunk is a few kernel launches, so chunks are large (256 MB of float32 rows)
#: and a batch takes one or a few
_SCORE_CHUNK_FLOATS = {"cpu": 1 << 18, "cuda": 1 << 26}


class _GatheredScores(torch.autograd.Function):
    """`scores[t, k] = query[t] . rows[index[t, k]]` and its gradients, chunk by chunk of positions.

    Written out because autograd's form (`rows[index]`, then a batched product) materialises
    `[T, K, D]` rows forward and their gradient backward: at ML-1M's sizes (13,600 positions, 128
    negatives, width 50) 350 MB each, written and read again through main memory. Here every
    chunk's rows are gathered into the cache, used at once, and gathered again in the backward
    pass; the rows' gradient is summed into `[U, D]` by `index_add_` (in order on the CPU, so
    bitwise reproducible there)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, query: torch.Tensor, rows: torch.Tensor, index: torch.Tensor):
        t, k = index.shape
        step = _chunk(k, rows.shape[1], rows.device)
        scores = query.new_empty(t, k)
        for a in range(0, t, step):
            b = min(a + step, t)
            gathered = rows.index_select(0, index[a:b].reshape(-1)).view(b - a, k, -1)
            torch.bmm(gathered, query[a:b, :, None], out=scores[a:b, :, None])
        ctx.save_for_backward(query, rows, index)
        return scores

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor):
        query, rows, index = ctx.saved_tensors
        t, k = index.shape
        step = _chunk(k, rows.shape[1], rows.device)
        grad = grad.contiguous()
        grad_query = torch.empty_like(query) if ctx.needs_input_grad[0] else None
        grad_rows = torch.zeros_like(rows) if ctx.needs_input_grad[1] else None
        for a in range(0, t, step):
            b = min(a + step, t)
            if grad_query is not None:
                gathered = rows.index_select(0, index[a:b].reshape(-1)).view(b - a, k, -1)
                torch.bmm(grad[a:b, None, :], gathered, out=grad_query[a:b, None, :])
            if grad_rows is not None:
                outer = grad[a:b, :, None] * query[a:b, None, :]  # [chunk, K, D]
                grad_rows.index_add_(0, index[a:b].reshape(-1), outer.view(-1, query.shape[1]))
        return grad_query, grad_rows, None


def _chunk(k: int, d: int, device: torch.device) -> int:
    """Positions per chunk: about `_SCORE_CHUNK_FLOATS` floats of gathered `[K, D]` rows."""
    budget = _SCORE_CHUNK_FLOATS.get(device.type, _SCORE_CHUNK_FLOATS["cpu"])
    return max(1, budget // max(1, k * d))


def gathered_scores(query: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`[T, K]` scores of each position's own rows: `query[t] . rows[index[t, k]]` (`query`
    `[T, D]`, `rows` `[U, D]`, `index` `[T, K]` int64), differentiable in `query` and `rows`."""
    return _GatheredScores.apply(query, rows, index)


def feature_ids(ids: KeyedJaggedTensor, key: str) -> torch.Tensor:
    """The ids of feature `key` of a KJT, in jagged order (one slice of its values)."""
    per_key = ids.length_per_key()  # host ints, cached by the KJT
    k = ids.keys().index(key)
    start = sum(per_key[:k])
    return ids.values()[start : start + per_key[k]]


class RetrievalModel(nn.Module):
    """`EmbeddingCollection` (`ec`, sharded by DMP) + `RetrievalHead` (`head`, dense/DDP).

    `forward(batch) -> (loss, outputs)`; see the module docstring for the loss and the outputs.
    """

    def __init__(
        self,
        cfg: RetrievalConfig,
        spec: DataSpec,
        encoder: Callable[[RetrievalConfig], nn.Module],
        device: torch.device | None = None,
    ) -> None:
        """`encoder(cfg)` makes the causal sequence encoder: `(embeddings [B, N, D], timestamps
        [B, N + 1] (`padded_times`), valid [B, N]) -> [B, N, D]` on left-padded sequences (each model's builder passes
        its own; made after the item table, so the initial weights do not depend on the caller)."""
        super().__init__()
        self.ec = split_collection([item_table(cfg, spec)], spec.managed, device=device)
        self.head = RetrievalHead(cfg, encoder, raw_ids=bool(spec.managed))

    def dense_modules(self) -> list[nn.Module]:
        """What `trainer.compile` compiles: the sequence encoder (`DenseSubmodules`); the loss
        and the ranks read the batch's KJT on the host."""
        return [self.head.encoder]

    def forward(self, batch: RetrievalBatch) -> ModelOutput:
        embeddings = self.ec(batch.sparse_features)
        return self.head(embeddings, batch.sparse_features, batch.timestamps, batch.target_timestamps, batch.neg_index)

    def serving(self, data: DataConfig) -> ServingForm:
        """The serving program (`Servable`): `(items, timestamps, valid)` -> the user vectors
        `[B, D]`; `items` and `valid` are `[B, max_seq_len]` and left-padded, `timestamps` is
        `[B, max_seq_len + 1]` (`padded_times`: the last column is the time of the item to come).
        The item table holds the vectors they score (normalised where the loss normalises), so
        `user @ item_table[i]` is the score evaluation ranks item `i` by.

        With a managed item table (`data.ids=managed`) `items` are raw ids, remapped by the
        program (`RawIdRemap`), and `item_remap` lets the export make the item table the
        catalogue's vectors (`ServingForm.over_catalogue`)."""
        head = self.head
        tables, remaps = served_tables(self.ec)
        weight, remap = tables[ITEM_TABLE], remaps.get(INPUT_KEY)
        n = head.max_len

        def inputs(batch: RetrievalBatch) -> tuple[torch.Tensor, ...]:
            lengths = batch.lengths(INPUT_KEY)
            items, valid = left_pad(feature_ids(batch.sparse_features, INPUT_KEY)[:, None], lengths, n)
            return items[..., 0], padded_times(batch.timestamps, batch.target_timestamps, lengths, n), valid

        def users(batch: RetrievalBatch) -> int:
            return batch.sample_ids.numel()

        return ServingForm(
            module=_UserEncoder(weight, head, remap),
            input_names=("items", "timestamps", "valid"),
            inputs=inputs,
            reference=lambda batch, outputs: outputs["logits"].view(users(batch), -1),
            item_table=head._normalise(weight.detach()[:, : head.dim]).clone(),
            candidates=lambda batch: feature_ids(batch.sparse_features, CAND_KEY).view(users(batch), -1),
            program="retrieval",
            slots={"items": ("item",), "timestamps": ("timestamp",)},
            params={"max_seq_len": n},
            item_remap=remap,
        )


class _UserEncoder(nn.Module):
    """The user side of a `RetrievalModel` on padded tensors: item lookup (a plain tensor index,
    so the program needs no torchrec), the trained encoder, the last position's vector."""

    def __init__(self, weight: torch.Tensor, head: RetrievalHead, remap: nn.Module | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.head = head
        #: raw item ids (`data.ids=managed`) to rows, as the managed table looked them up
        self.rows = remap if remap is not None else nn.Identity()

    def forward(self, items: torch.Tensor, timestamps: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = torch.where(valid[..., None], self.weight[self.rows(items)][..., : self.head.dim], 0.0)  # left_pad's zeros
        # an encoder whose training forward runs jagged operators offers the same on padded tensors
        encode = getattr(self.head.encoder, "forward_padded", self.head.encoder)
        h = encode(x, timestamps, valid)
        return self.head._normalise(h[:, -1])
