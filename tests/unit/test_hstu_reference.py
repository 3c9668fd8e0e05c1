"""HSTU retrieval against generative-recommenders' research HSTU: the same maths.

With a clone of meta-recsys/generative-recommenders (`$RECSYS_HSTU_REFERENCE`), our encoder and
the reference's, holding the same weights, run the same jagged batch (dropout off): outputs,
sampled-softmax loss (the same negatives: per position, the reference's `LocalNegativesSampler`
made to return our data's negatives; or one shared pool) and every weight's gradient agree within
1e-5 relative. Without the clone (CI), a hand-written re-computation of the reference's formulas
(`reference_formulas`, written from its `hstu.py`) is checked against our encoder instead.
Also: HSTU-large (`model=hstu_retrieval_large`) builds and trains.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _process_group import one_rank_group
from _retrieval_batches import with_collisions

from recsys_pipe.bench.hstu import (
    _REFERENCE_FILE,
    REFERENCE_ENV,
    Sizes,
    build_reference,
    copy_weights,
    load_reference,
    reference_forward,
    reference_gradients,
    reference_inputs,
)
from recsys_pipe.data.batch import INPUT_KEY, collate_retrieval
from recsys_pipe.data.in_memory.sequences import SequencesDataConfig
from recsys_pipe.models.hstu_retrieval import HSTURetrievalConfig, build_hstu_retrieval
from recsys_pipe.models.retrieval import ITEM_TABLE, left_pad, padded_times

REFERENCE = os.environ.get(REFERENCE_ENV, "")
needs_reference = pytest.mark.skipif(
    not (REFERENCE and (Path(REFERENCE) / _REFERENCE_FILE).is_file()),
    reason=f"needs a clone of meta-recsys/generative-recommenders: set {REFERENCE_ENV} to its path",
)
DATA_LEN, ATTN_LEN, DIM, NEGATIVES = 8, 19, 16, 12  # ATTN_LEN: data length + 11, as the reference pads


def _ratings(tmp_path: Path) -> Path:
    """A MovieLens ratings file: 7 users of 3..14 items over 30 items, timestamps whose gaps span
    seconds to months (many time buckets), some sequences longer than DATA_LEN."""
    g = torch.Generator().manual_seed(3)
    lines = []
    for user in range(1, 8):
        n = int(torch.randint(3, 15, (1,), generator=g))
        items = torch.randperm(30, generator=g)[:n] + 1
        gaps = (10 ** (torch.rand(n, generator=g) * 7)).long()  # 1 s .. ~4 months
        stamps = 978300000 + torch.cumsum(gaps, 0)
        lines += [f"{user}::{int(i)}::4::{int(t)}" for i, t in zip(items, stamps)]
    path = tmp_path / "ratings.dat"
    path.write_text("\n".join(lines) + "\n")
    return path


def _setup(tmp_path: Path, heads: int = 2, layers: int = 2, negatives: str = "per_position"):
    cfg = HSTURetrievalConfig(
        embedding_dim=DIM,
        max_seq_len=ATTN_LEN,
        num_layers=layers,
        num_heads=heads,
        dropout=0.0,
        num_negatives=NEGATIVES,
        negatives=negatives,
    )
    data = SequencesDataConfig(path=str(_ratings(tmp_path)), max_seq_len=DATA_LEN, eval_negatives=5)
    dataset = cfg.data_for_model(data).dataset(0, 1)  # the negatives per target the loss needs
    batch = collate_retrieval([dataset[i] for i in range(len(dataset))])
    torch.manual_seed(0)
    return dataset, batch, cfg, build_hstu_retrieval(cfg, dataset.spec)


def _encoder_inputs(model, batch):
    table = model.ec.embeddings[ITEM_TABLE].weight[:, :DIM]
    lengths = batch.lengths(INPUT_KEY).long()
    x, valid = left_pad(table[batch.sparse_features[INPUT_KEY].values()], lengths, ATTN_LEN)
    return x, padded_times(batch.timestamps, batch.target_timestamps, lengths, ATTN_LEN), valid


def _given_negatives_sampler(ref_modules, ids: torch.Tensor) -> type:
    """The reference's `LocalNegativesSampler` returning the negatives `ids` (`[positions, K]`,
    reference ids, position by position in its jagged order) instead of drawing them."""

    class GivenNegativesSampler(ref_modules.LocalNegativesSampler):
        def forward(self, positive_ids: torch.Tensor, num_to_sample: int) -> tuple[torch.Tensor, torch.Tensor]:
            assert ids.shape == (*positive_ids.shape, num_to_sample)
            return ids, self.normalize_embeddings(self._item_emb(ids))

    return GivenNegativesSampler


@needs_reference
@pytest.mark.parametrize(("heads", "negatives"), [(1, "per_position"), (2, "per_position"), (2, "shared")])
def test_hstu_matches_the_reference_on_the_same_weights_and_batch(tmp_path, heads, negatives):
    """Per position: the reference's own sampler class returns our data's negatives (some equal
    to their target: both mask them); shared: its sampler returns our pool for every position."""
    dataset, batch, cfg, ours = _setup(tmp_path, heads=heads, negatives=negatives)
    batch = with_collisions(batch, dataset.negatives_per_target)
    ref_modules = load_reference(REFERENCE)
    sizes = Sizes(
        data_len=DATA_LEN, dim=DIM, blocks=2, heads=heads, negatives=NEGATIVES, batch=len(dataset), dropout=0.0
    )
    ref = build_reference(
        ref_modules, sizes, dataset.num_items, attn_len=ATTN_LEN, shared_negatives=negatives == "shared"
    )
    neg_ids = batch.negatives_per_position() + 1  # in the reference's ids
    if negatives == "shared":
        ref.sampler.pool = neg_ids[:NEGATIVES]  # our pool
    else:
        assert dataset.negatives_per_target == NEGATIVES
        given = _given_negatives_sampler(ref_modules, neg_ids.view(-1, NEGATIVES))
        ref.sampler = given(  # as build_reference makes its LocalNegativesSampler
            num_items=dataset.num_items,
            item_emb=ref.model._embedding_module._item_emb,
            all_item_ids=list(range(1, dataset.num_items + 1)),
            l2_norm=True,
            l2_norm_eps=1e-6,
        )
    copy_weights(ours, ref)
    outputs = []
    ours.head.encoder.register_forward_hook(lambda module, args, out: outputs.append(out))
    loss, _ = ours(batch)
    loss.backward()
    ref_out, ref_loss = reference_forward(ref, reference_inputs(batch, ATTN_LEN))
    ref_loss.backward()

    x, ts, valid = _encoder_inputs(ours, batch)
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(valid.sum(1))
    ref_jagged = torch.ops.fbgemm.dense_to_jagged(ref_out, [offsets])[0]
    torch.testing.assert_close(outputs[0][valid], ref_jagged, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    pairs = reference_gradients(ours, ref)
    assert len(pairs) == 2 + 2 * 5
    for name, (mine, theirs) in pairs.items():
        scale = float(theirs.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5 * scale, msg=name)


@needs_reference
def test_the_reference_trainer_ranks_as_ours_on_the_same_weights(tmp_path):
    """`hstu_train_reference`'s evaluation (what the Games comparison reports for the reference)
    gives the ranks our model gives on the same weights, under both protocols."""
    from recsys_pipe.bench.hstu_train_reference import reference_ranks

    dataset, _, _, ours = _setup(tmp_path)
    ref = build_reference(
        load_reference(REFERENCE),
        Sizes(data_len=DATA_LEN, dim=DIM, blocks=2, heads=2, negatives=NEGATIVES, batch=8, dropout=0.0),
        dataset.num_items,
        attn_len=ATTN_LEN,
    )
    copy_weights(ours, ref)
    split = dataset.split("test", 16)
    batch = split.collate([split[i] for i in range(len(split))])
    ours.eval()
    with torch.no_grad():
        _, out = ours(batch)
    real = batch.sample_ids >= 0
    theirs = reference_ranks(ref, dataset, "test", ATTN_LEN)
    assert int(real.sum()) == len(theirs["full"]) == 7
    assert out["rank_sampled"][real].tolist() == theirs["sampled"].tolist()
    assert out["rank_full"][real].tolist() == theirs["full"].tolist()
    assert len(set(theirs["full"].tolist())) > 1  # ranks that tell the users apart


def reference_formulas(encoder, x, timestamps, valid) -> torch.Tensor:
    """generative-recommenders' HSTU (rel_bias normalisation, L2-normalised output) written out
    per sequence from its hstu.py, input_features_preprocessors.py and output_postprocessors.py:
    the jagged `[T, D]` output."""
    n, d = encoder.max_len, x.shape[-1]
    out = []
    for b in range(x.shape[0]):
        m = int(valid[b].sum())
        items, times, next_times = x[b][valid[b]], timestamps[b, :n][valid[b]], timestamps[b, 1:][valid[b]]
        h = items * math.sqrt(d) + encoder.position.weight[:m]  # the oldest item at position 0
        i, j = torch.arange(m)[:, None], torch.arange(m)[None, :]
        gap = (next_times[:, None] - times[None, :]).abs().clamp(min=1)
        for layer, bias in zip(encoder.layers, encoder.biases):
            heads = layer.num_heads
            bucket = (torch.log(gap.float()) / 0.301).long().clamp(0, bias.num_time_buckets)
            rel = bias.position[j - i + n - 1] + bias.time[bucket]  # [m, m]
            u, v, q, k = F.silu(F.layer_norm(h, [d], eps=1e-6) @ layer.uvqk.weight.T).split(d, dim=-1)
            attended = []
            for head in range(heads):
                part = slice(head * d // heads, (head + 1) * d // heads)
                a = F.silu(q[:, part] @ k[:, part].T + rel) / n * (j <= i)
                attended.append(a @ v[:, part])
            y = u * F.layer_norm(torch.cat(attended, dim=-1), [d], eps=1e-6)
            h = h + y @ layer.output.weight.T + layer.output.bias
        out.append(h / h.norm(dim=-1, keepdim=True).clamp(min=1e-6))
    return torch.cat(out)


@pytest.mark.parametrize("heads", [1, 2])
def test_hstu_encoder_computes_the_references_formulas(tmp_path, heads):
    """The CPU check CI runs (no clone there): our jagged, batched encoder against the
    reference's equations written out sequence by sequence."""
    _, batch, _, model = _setup(tmp_path, heads=heads)
    encoder = model.head.encoder.eval()
    x, ts, valid = _encoder_inputs(model, batch)
    assert len(set(valid.sum(1).tolist())) > 2 and int(valid.sum(1).max()) == DATA_LEN  # varied, some cut
    with torch.no_grad():
        before = encoder(x, ts, valid)[valid]
        torch.testing.assert_close(before, reference_formulas(encoder, x, ts, valid))
        encoder.biases[1].time.add_(torch.randn_like(encoder.biases[1].time))  # each block reads its own bias
        after = encoder(x, ts, valid)[valid]
        torch.testing.assert_close(after, reference_formulas(encoder, x, ts, valid))
        assert not torch.allclose(after, before)


def test_time_bias_reads_the_time_of_the_predicted_item(tmp_path):
    """Query position p's bias reads the time of the item it predicts (position p + 1's; the
    last position: the target's), as the reference's `ts(next) - ts(current)`: changing only
    the target's time changes only the last position's output."""
    _, batch, _, model = _setup(tmp_path)
    encoder = model.head.encoder.eval()
    x, ts, valid = _encoder_inputs(model, batch)
    later = ts.clone()
    later[:, -1] += 10**7
    with torch.no_grad():
        a, b = encoder(x, ts, valid), encoder(x, later, valid)
    assert not torch.allclose(a[:, -1], b[:, -1])
    torch.testing.assert_close(a[:, :-1], b[:, :-1], rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_hstu_large_builds_and_trains_through_the_configs(tmp_path):
    """`model=hstu_retrieval_large`: the paper's HSTU-large (8 blocks, 2 heads) trains a few steps."""
    from recsys_pipe.testing import load_run
    from recsys_pipe.train import Trainer, build_parts, training_plan

    run = load_run(
        "data=sequences",
        f"data.path={_ratings(tmp_path)}",
        f"data.max_seq_len={DATA_LEN}",
        "data.batch_size=4",
        "data.eval_negatives=5",
        "model=hstu_retrieval_large",
        f"model.max_seq_len={ATTN_LEN}",
        f"model.embedding_dim={DIM}",
        f"model.num_negatives={NEGATIVES}",
        "pipeline=serial",
        "trainer.device=cpu",
        "trainer.max_steps=3",
        "trainer.epochs=10",
        "trainer.eval_every=0",
        "trainer.progress_bar=false",
        f"trainer.output_dir={tmp_path}/runs",
    )
    assert (run.model.num_layers, run.model.num_heads) == (8, 2)
    with one_rank_group() as info:
        trainer = Trainer(build_parts(run, training_plan(run), info))
        try:
            encoder = {name: p for name, p in trainer.state.model.named_parameters() if ".encoder." in name}
            before = {name: p.detach().clone() for name, p in encoder.items()}
            summary = trainer.fit()
        finally:
            trainer.close()
    layers = {name.split(".layers.")[1].split(".")[0] for name in encoder if ".layers." in name}
    biases = {name.split(".biases.")[1].split(".")[0] for name in encoder if ".biases." in name}
    assert layers == biases == {str(i) for i in range(8)}
    assert summary.steps == 3 and math.isfinite(summary.last_loss)
    assert all(not torch.equal(before[name], p) for name, p in encoder.items())  # every weight trained
