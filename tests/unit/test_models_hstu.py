"""recsys_pipe.models.hstu: output contract, attention structure, FX contract, learning."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pydantic import ValidationError
from torchmetrics.classification import BinaryAUROC
from torchrec.distributed.train_pipeline.tracing import Tracer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_pipe.data import (
    ACTION_KEY,
    ITEM_KEY,
    USER_KEY,
    DataSpec,
    SequenceBatch,
    SyntheticConfig,
    SyntheticDataConfig,
    make_dataloader,
)
from recsys_pipe.models import MODELS, HSTUConfig, build_hstu, embedding_tables


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """On a loaded 2-core box, 2 OpenMP threads can turn a 1 s training test into 20 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _setup(use_user: bool = False, relative_bias: bool = True, **data_kw):
    data_kw = {"batch_size": 8, "max_seq_len": 12, "num_candidates": 3, **data_kw}
    synthetic = SyntheticConfig(num_items=100, num_users=50, num_clusters=4)
    cfg = SyntheticDataConfig(use_user_feature=use_user, synthetic=synthetic, **data_kw)
    loader = make_dataloader(cfg)
    torch.manual_seed(0)
    model = build_hstu(HSTUConfig(max_seq_len=cfg.max_seq_len, relative_bias=relative_bias), loader.dataset.spec)
    return model, loader


def _with_items(batch: SequenceBatch, items: torch.Tensor) -> SequenceBatch:
    kjt = batch.sparse_features
    values = kjt.values().clone()
    values[: items.numel()] = items  # "item" is the first key
    new = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    return dataclasses.replace(batch, sparse_features=new)


def test_fbgemm_jagged_ops_available() -> None:
    for op in ("jagged_to_padded_dense", "dense_to_jagged", "jagged_1d_to_dense", "asynchronous_complete_cumsum"):
        assert hasattr(torch.ops.fbgemm, op), op


@pytest.mark.parametrize("use_user,relative_bias", [(False, True), (True, True), (True, False)])
def test_forward_contract(use_user: bool, relative_bias: bool) -> None:
    model, loader = _setup(use_user, relative_bias)
    batch = next(iter(loader))
    loss, aux = model(batch)
    n_cand = int(batch.num_candidates.sum())
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert aux["logits"].shape == aux["labels"].shape == (n_cand, loader.dataset.spec.num_tasks)
    assert not aux["logits"].requires_grad
    assert int(aux["num_candidates"]) == n_cand
    extra = batch.batch_size if use_user else 0
    assert int(aux["num_tokens"]) == batch.timestamps.numel() + extra
    assert torch.allclose(loss, aux["task_losses"].sum())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]


def test_candidates_are_scored_independently_and_see_history() -> None:
    model, loader = _setup()
    num_items = loader.dataset.spec.vocab_sizes[ITEM_KEY]
    batch = next(iter(loader))
    items = batch.sparse_features[ITEM_KEY].values()
    first_len = int(batch.sparse_features[ITEM_KEY].lengths()[0])
    n_c = int(batch.num_candidates[0])
    with torch.no_grad():
        base = model(batch)[1]["logits"]
        # change the first sample's first candidate: only its own logits may move
        cand = items.clone()
        cand[first_len - n_c] = (cand[first_len - n_c] + 1) % num_items
        moved = model(_with_items(batch, cand))[1]["logits"]
        # change the first sample's first history item: all its candidates move, no one else's
        hist = items.clone()
        hist[0] = (hist[0] + 1) % num_items
        hist_moved = model(_with_items(batch, hist))[1]["logits"]
    assert not torch.allclose(moved[0], base[0])
    torch.testing.assert_close(moved[1:], base[1:], rtol=0, atol=1e-6)
    assert all(not torch.allclose(hist_moved[j], base[j]) for j in range(n_c))
    torch.testing.assert_close(hist_moved[n_c:], base[n_c:], rtol=0, atol=1e-6)


def test_samples_do_not_interact_through_padding() -> None:
    model, loader = _setup(use_user=True)
    batch = next(iter(loader))
    with torch.no_grad():
        full = model(batch)[1]["logits"]
        small_loader = _setup(use_user=True, batch_size=1)[1]
        first = model(next(iter(small_loader)))[1]["logits"]
    torch.testing.assert_close(first, full[: first.shape[0]], rtol=1e-5, atol=1e-6)


def test_fx_trace_exposes_ec_input_as_batch_attribute() -> None:
    """What torchrec's _rewrite_model relies on: `ec` is called on `batch.sparse_features`."""
    model, _ = _setup()
    graph = Tracer(leaf_modules=["ec", "ranker"]).trace(model)
    (ec_call,) = [n for n in graph.nodes if n.op == "call_module" and n.target == "ec"]
    (arg,) = ec_call.args
    assert arg.op == "call_function" and arg.target is getattr and arg.args[1] == "sparse_features"
    assert arg.args[0].op == "placeholder"


def test_tables_share_dim_and_avoid_moduledict_names() -> None:
    cfg = HSTUConfig()
    tables = embedding_tables(cfg, DataSpec(num_tasks=1, vocab_sizes={ITEM_KEY: 10, ACTION_KEY: 3, USER_KEY: 4}))
    assert {t.embedding_dim for t in tables} == {cfg.embedding_dim}
    assert [t.feature_names for t in tables] == [["item"], ["action"], ["user"]]
    no_user = embedding_tables(cfg, DataSpec(num_tasks=1, vocab_sizes={ITEM_KEY: 10, ACTION_KEY: 3}))
    assert [t.feature_names for t in no_user] == [["item"], ["action"]]
    with pytest.raises(ValidationError, match="embedding_dim .30. is not divisible by num_heads .4."):
        HSTUConfig(embedding_dim=30, num_heads=4)
    assert MODELS.config_class({"name": "hstu"}, "model") is HSTUConfig


def test_learns_synthetic_structure() -> None:
    """A few seconds of single-process training: loss falls and AUC is well above chance."""
    model, loader = _setup(batch_size=64, max_seq_len=16, num_candidates=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    aucs = [BinaryAUROC() for _ in range(loader.dataset.spec.num_tasks)]
    losses = []
    for step, batch in zip(range(100), loader):
        loss, aux = model(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step >= 80:
            for t, auc in enumerate(aucs):
                auc.update(aux["logits"][:, t], aux["labels"][:, t].long())
    first, last = sum(losses[:10]) / 10, sum(losses[-20:]) / 20
    scores = [float(a.compute()) for a in aucs]
    assert last < first - 0.1, (first, last)
    assert min(scores) > 0.6 and sum(scores) / len(scores) > 0.65, scores


def test_summed_backward_lookup_matches_indexing_and_passes_gradcheck() -> None:
    """`SummedBackwardLookup` (the attention bias's lookup on CUDA, `bias_lookup`) gives indexing's
    values and table gradient, on buckets as skewed as real gaps (most in one entry), an empty
    index included; run here on the CPU, where `bias_lookup` itself indexes."""
    from recsys_pipe.models.hstu import RelativeBias, SummedBackwardLookup, bias_lookup

    gen = torch.Generator().manual_seed(3)
    bias = RelativeBias(16, 32)
    times = torch.randint(3_600, 30 * 86_400, (8, 16), generator=gen).cumsum(1)
    for index in (bias.bucketize(times), torch.zeros(0, 4, 4, dtype=torch.int64)):
        grad = torch.randn(index.shape, generator=gen)
        table = bias.time.detach().clone().requires_grad_(True)
        ours = SummedBackwardLookup.apply(table, index)
        ours.backward(grad)
        reference = bias.time.detach().clone().requires_grad_(True)
        expected = bias_lookup(reference, index)
        expected.backward(grad)
        assert torch.equal(ours, expected)
        torch.testing.assert_close(table.grad, reference.grad, rtol=1e-5, atol=1e-6)
    skewed = bias.bucketize(times).reshape(-1)
    assert torch.bincount(skewed).max() > skewed.numel() // 2  # as real gaps: most in one bucket
    table64 = torch.randn(33, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: SummedBackwardLookup.apply(t, bias.bucketize(times)[:2]), (table64,))
