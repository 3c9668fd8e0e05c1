"""Next-item retrieval: the sequences source (formats, leave-one-out split, negatives, ranks),
the SASRec / HSTU retrieval models (losses, evaluation ranks), the metrics (against
torchmetrics) and a `recsys-train` run whose dump recomputes its logged metrics."""

from __future__ import annotations

import csv
import json
import math
import os
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from _process_group import one_rank_group
from _retrieval_batches import with_collisions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from torchmetrics.retrieval import RetrievalHitRate, RetrievalMRR, RetrievalNormalizedDCG

from recsys_pipe.cli import train as train_cli
from recsys_pipe.config import ConfigError
from recsys_pipe.data import make_dataloader
from recsys_pipe.data.batch import CAND_KEY, CATALOG_KEY, INPUT_KEY, NEG_KEY, POS_KEY, collate_retrieval
from recsys_pipe.data.in_memory.sequences import SequencesDataConfig, SequencesDataset, read_interactions
from recsys_pipe.data.negatives import EVAL, TRAIN, unseen_items
from recsys_pipe.data.source import RankData
from recsys_pipe.models.hstu_retrieval import HSTURetrievalConfig
from recsys_pipe.models.retrieval import gathered_scores, left_pad, padded_times
from recsys_pipe.models.sasrec import SASRecConfig
from recsys_pipe.train.retrieval_eval import KS, retrieval_metrics


@pytest.fixture(autouse=True)
def _leave_no_process_group():
    """Tests here train in-process (`train_cli.run`): the 1-rank group a run starts is torn down
    afterwards."""
    with one_rank_group(start=False):
        yield


def _pairs(tmp_path: Path, users: int = 60, items: int = 40, seed: int = 0, name: str = "seq.txt") -> Path:
    """A "user item" file: user u's items follow a chain with some noise (learnable order)."""
    g = torch.Generator().manual_seed(seed)
    lines = []
    for u in range(1, users + 1):
        n = int(torch.randint(2, 15, (1,), generator=g))
        start = int(torch.randint(0, items, (1,), generator=g))
        lines += [f"{u * 7} {(start + k) % items + 100}" for k in range(n)]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


# -- data -----------------------------------------------------------------------------------------


def test_user_item_lines_keep_file_order_and_remap_densely(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("5 30\n5 10\n2 20\n5 20\n2 30\n\n2 10\n7 40\n")
    data = read_interactions(path)
    assert data.users == [2, 5, 7]
    assert data.items == [[20, 30, 10], [30, 10, 20], [40]]  # file order is time order
    ds = SequencesDataset(data, max_seq_len=10, eval_negatives=1)
    assert ds.raw_items == [10, 20, 30, 40] and ds.sequences == [[1, 2, 0], [2, 0, 1], [3]]


def test_movielens_ratings_are_sorted_by_time(tmp_path):
    path = tmp_path / "ratings.dat"
    path.write_text("1::50::4::300\n1::40::3::100\n2::50::5::10\n1::60::1::200\n")
    data = read_interactions(path)
    assert data.users == [1, 2] and data.items == [[40, 60, 50], [50]]
    assert data.timestamps[0] == [100, 200, 300]


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("1 2\n1 2 3\n", "s.txt:2: expected two fields `user item`"),
        ("1 2\n" * 3000 + "x 3\n", "s.txt:3001: user and item must be integers"),  # integer ids in its first lines
        ("", "s.txt: the file has no interactions"),
        (b"\x00\x01\x02", "s.txt: a binary file"),
        ("1::2::4::100\n1::3::9::101\n", "s.txt:2: rating '9' is outside (0, 5]"),
    ],
)
def test_bad_files_name_the_file_and_line(tmp_path, content, fragment):
    path = tmp_path / "s.txt"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as info:
        read_interactions(path)
    assert info.value.problems[0].path == "data.path" and fragment in str(info.value)


def test_recsys_train_refuses_a_bad_file_with_exit_2(tmp_path, capsys, no_process_group):
    path = tmp_path / "bad.txt"
    path.write_text("1 2\n1 3\n" * 1500 + "1 four\n")  # integer ids in its first lines: a text id later is bad
    code = train_cli.run(["data=sequences", f"data.path={path}", "model=sasrec", f"trainer.output_dir={tmp_path}/runs"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error: data.path" in err and "bad.txt:3001: user and item must be integers" in err
    assert "Traceback" not in err


def test_leave_one_out_split_is_the_papers():
    seqs = [[0, 1, 2, 3, 4], [5, 6], [7, 8, 9]]
    from recsys_pipe.data.in_memory.sequences import Interactions

    data = Interactions([1, 2, 3], [list(s) for s in seqs], [list(range(len(s))) for s in seqs])
    ds = SequencesDataset(data, max_seq_len=50, eval_negatives=2)
    by_user = {ds[i].sample_id: ds[i] for i in range(len(ds))}
    # user 0: train [0, 1, 2], validation 3, test 4; user 1 (2 items) trains on both, is never evaluated;
    # user 2: train [7] alone has no transition, so it trains nothing, but is evaluated
    assert set(by_user) == {0, 1}
    assert by_user[0].inputs == [0, 1] and by_user[0].targets == [1, 2]
    assert by_user[1].inputs == [5] and by_user[1].targets == [6]
    valid, test = ds.split("valid", 4), ds.split("test", 4)
    assert [valid[i].sample_id for i in range(len(valid))] == [0, 2, -1, -1]
    assert valid[0].inputs == [0, 1, 2] and valid[0].candidates[0] == 3
    assert test[0].inputs == [0, 1, 2, 3] and test[0].candidates[0] == 4
    assert test[1].inputs == [7, 8] and test[1].candidates[0] == 9


def test_long_sequences_keep_their_last_items():
    from recsys_pipe.data.in_memory.sequences import Interactions

    seq = list(range(20))
    other = [100, 101]  # items user 1 never saw, for its negatives
    ds = SequencesDataset(Interactions([1, 2], [seq, other], [seq, [0, 1]]), max_seq_len=5, eval_negatives=1)
    assert ds[0].inputs == [12, 13, 14, 15, 16] and ds[0].targets == [13, 14, 15, 16, 17]
    assert ds.split("test", 1)[0].inputs == [14, 15, 16, 17, 18]


def test_negatives_are_unseen_seeded_and_fresh_every_epoch(tmp_path):
    data = read_interactions(_pairs(tmp_path))
    ds = SequencesDataset(data, max_seq_len=50, eval_negatives=10, seed=3)
    again = SequencesDataset(data, max_seq_len=50, eval_negatives=10, seed=3)
    for i in range(len(ds)):
        sample = ds[i]
        train_items = set(ds.sequences[sample.sample_id][:-2])
        assert len(sample.negatives) == len(sample.targets) and not set(sample.negatives) & train_items
        other = again[i]
        assert other.negatives.tolist() == sample.negatives.tolist()
        assert (other.inputs, other.targets, other.timestamps) == (sample.inputs, sample.targets, sample.timestamps)
    epochs = [ds[len(ds) * e + 3].negatives.tolist() for e in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]
    assert ds[len(ds) + 3].inputs == ds[3].inputs
    test = ds.split("test", 8)
    for i in range(len(test.users)):
        sample = test[i]
        assert len(sample.candidates) == 11
        assert not set(sample.candidates[1:]) & set(ds.sequences[sample.sample_id])  # never an item the user saw


# -- the negative sampler (recsys_pipe.data.negatives) ---------------------------------------------

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's output function on Python integers: an independent statement of the hash."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _reference_negatives(seed, domain, epoch, user, count, seen, num_items):
    """The documented draw, one position and attempt at a time in plain Python (pins every draw:
    an optimisation of `unseen_items` that changed any negative fails here)."""
    key = _splitmix64(seed % (1 << 64))
    for word in (domain, epoch, user):
        key = _splitmix64(key ^ (word % (1 << 64)))
    out = []
    for j in range(count):
        r = 0
        while (item := _splitmix64(key ^ (r << 32 | j)) % num_items) in seen:
            r += 1
        out.append(item)
    return out


def _draw(users, counts, seen, num_items, seed=0, domain=TRAIN, epoch=0):
    flat = np.array([i for s in seen for i in s], dtype=np.int64)
    lengths = [len(s) for s in seen]
    starts = np.cumsum([0, *lengths])[:-1]
    return unseen_items(seed, domain, epoch, np.array(users), np.array(counts), flat, starts, lengths, num_items)


def test_unseen_items_are_the_documented_hash_draws():
    seen = [[0, 3, 3, 7], [], [1, 2, 4, 5, 6, 8, 9], [5]]
    for seed, domain, epoch in ((0, TRAIN, 0), (-3, TRAIN, 7), (2**70 + 5, EVAL, 0)):
        got = _draw([4, 0, 11, 2**40], [5, 3, 6, 0], seen, 10, seed, domain, epoch).tolist()
        want = [
            i
            for u, c, s in zip([4, 0, 11, 2**40], [5, 3, 6, 0], seen)
            for i in _reference_negatives(seed, domain, epoch, u, c, set(s), 10)
        ]
        assert got == want
    assert _draw([4], [5], seen[:1], 10, domain=TRAIN).tolist() != _draw([4], [5], seen[:1], 10, domain=EVAL).tolist()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_users_negatives_do_not_depend_on_its_batch(data):
    """Any batch of users (any order, any company) draws each user what it draws alone: unseen
    items only, `count` of them."""
    num_items = data.draw(st.integers(2, 30))
    n = data.draw(st.integers(1, 8))
    users = data.draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n, unique=True))
    counts = data.draw(st.lists(st.integers(0, 12), min_size=n, max_size=n))
    seen = [
        data.draw(st.lists(st.integers(0, num_items - 1), max_size=num_items).filter(lambda s: len(set(s)) < num_items))
        for _ in range(n)
    ]
    seed, epoch = data.draw(st.integers(-(2**63), 2**64)), data.draw(st.integers(0, 50))
    batch = _draw(users, counts, seen, num_items, seed, TRAIN, epoch)
    alone = [_draw([u], [c], [s], num_items, seed, TRAIN, epoch) for u, c, s in zip(users, counts, seen)]
    assert batch.tolist() == np.concatenate(alone).tolist()
    order = data.draw(st.permutations(range(n)))
    shuffled = _draw(
        [users[k] for k in order], [counts[k] for k in order], [seen[k] for k in order], num_items, seed, TRAIN, epoch
    )
    assert shuffled.tolist() == np.concatenate([alone[k] for k in order]).tolist()
    for a, c, s in zip(alone, counts, seen):
        assert len(a) == c and not set(a.tolist()) & set(s) and all(0 <= i < num_items for i in a.tolist())


def test_unseen_items_are_uniform_over_the_unseen_ones():
    """Chi-square over 7 unseen items of 10 (6 degrees of freedom): 70,000 draws over 10,000
    users; 40 is far above the 0.1% quantile (22.5), so only a real bias fails it."""
    seen = [[0, 4, 9]] * 10_000
    draws = _draw(range(10_000), [7] * 10_000, seen, 10, seed=12)
    observed = np.bincount(draws, minlength=10)
    assert observed[[0, 4, 9]].sum() == 0
    expected = len(draws) / 7
    chi2 = float((((observed[observed > 0] - expected) ** 2) / expected).sum())
    assert chi2 < 40, observed


def test_the_last_unseen_item_is_found_and_a_user_who_saw_everything_is_refused():
    for seed in range(5):
        everything_but_5 = [i for i in range(64) if i != 5]
        assert _draw([seed, 9], [20, 1], [everything_but_5, everything_but_5], 64, seed=seed).tolist() == [5] * 21
    with pytest.raises(ConfigError, match="a user interacted with all 4 items: no negatives"):
        _draw([1, 2], [0, 3], [[0, 1, 2, 3], [3, 2, 1, 1, 0]], 4)
    assert _draw([1], [0], [[0, 1, 2, 3]], 4).tolist() == []  # no negatives asked: nothing refused


def test_the_sequences_source_draws_with_the_shared_sampler(tmp_path):
    data = read_interactions(_pairs(tmp_path))
    ds = SequencesDataset(data, max_seq_len=50, eval_negatives=10, seed=3)
    for index in (0, 5, len(ds) + 5):
        sample = ds[index]
        user, epoch = sample.sample_id, index // len(ds)
        train = ds.sequences[user][:-2] if len(ds.sequences[user]) >= 3 else ds.sequences[user]
        want = _reference_negatives(3, TRAIN, epoch, user, len(sample.targets), set(train), ds.num_items)
        assert sample.negatives.tolist() == want
    sample = ds.split("test", 8)[0]
    seq = ds.sequences[sample.sample_id]
    assert sample.candidates[1:] == _reference_negatives(3, EVAL, 0, sample.sample_id, 10, set(seq), ds.num_items)


def test_the_training_sampler_numbers_epochs_so_negatives_change(tmp_path):
    cfg = SequencesDataConfig(path=str(_pairs(tmp_path)), batch_size=8, eval_negatives=5)
    data = RankData(cfg)
    assert data.eval_batches == 0  # the source evaluates on its own splits, no training tail held out
    epochs = list(data.train_loader(epochs=2))
    per_epoch = data.batches_per_epoch
    first, second = epochs[0], epochs[per_epoch]
    assert first.sparse_features[NEG_KEY].values().tolist() != second.sparse_features[NEG_KEY].values().tolist()


def test_ranks_read_disjoint_users(tmp_path):
    cfg = SequencesDataConfig(path=str(_pairs(tmp_path)), batch_size=4, eval_negatives=5)
    shares = [cfg.dataset(r, 2) for r in range(2)]
    users = [{ds[i].sample_id for i in range(len(ds))} for ds in shares]
    assert users[0] and users[1] and not users[0] & users[1]
    whole = cfg.dataset(0, 1)
    assert len(users[0] | users[1]) >= len(whole) - 1  # all but an odd one out
    evaluated = [{s.users[i] for i in range(len(s.users))} for s in (ds.split("test", 4) for ds in shares)]
    assert not evaluated[0] & evaluated[1]
    assert len(evaluated[0] | evaluated[1]) == len(whole.split("test", 4).users)
    assert len(shares[0].split("test", 4)) == len(shares[1].split("test", 4))  # same batch count per rank


def test_batches_carry_every_key_and_the_catalogue_in_order(tmp_path):
    cfg = SequencesDataConfig(path=str(_pairs(tmp_path)), batch_size=8, eval_negatives=5)
    train = next(iter(make_dataloader(cfg)))
    kjt = train.sparse_features
    assert kjt.keys() == [INPUT_KEY, POS_KEY, NEG_KEY, CAND_KEY, CATALOG_KEY]
    assert kjt[INPUT_KEY].lengths().tolist() == kjt[POS_KEY].lengths().tolist() == kjt[NEG_KEY].lengths().tolist()
    assert kjt[CAND_KEY].values().numel() == 0 and kjt[CATALOG_KEY].values().numel() == 0
    ds = cfg.dataset(0, 1)
    split = ds.split("valid", 8)
    batch = split.collate([split[i] for i in range(8)])
    assert batch.sparse_features[CATALOG_KEY].values().tolist() == list(range(ds.num_items))
    assert batch.sparse_features[CAND_KEY].lengths().tolist() == [6] * 8
    assert batch.sparse_features[POS_KEY].values().numel() == 0


# -- models ---------------------------------------------------------------------------------------


def test_left_pad_puts_each_sequence_at_the_end():
    values = torch.arange(6.0)[:, None]
    padded, valid = left_pad(values, torch.tensor([2, 0, 4]), 3)
    assert padded[..., 0].tolist() == [[0, 0, 1], [0, 0, 0], [3, 4, 5]]
    assert valid.tolist() == [[False, True, True], [False, False, False], [True, True, True]]


MODELS = [
    SASRecConfig(embedding_dim=16, max_seq_len=20, dropout=0.0),
    SASRecConfig(embedding_dim=16, max_seq_len=20, dropout=0.0, loss="sampled_softmax", num_negatives=7),
    HSTURetrievalConfig(embedding_dim=16, max_seq_len=20, dropout=0.0, num_negatives=6),
    HSTURetrievalConfig(embedding_dim=16, max_seq_len=20, dropout=0.0, num_negatives=6, negatives="shared"),
    HSTURetrievalConfig(embedding_dim=16, max_seq_len=20, dropout=0.0, loss="bce"),
]


def _vectors(model, batch):
    """Position vectors and the table rows, computed outside the model's head."""
    table = model.ec.embeddings["item_table"].weight[:, : model.head.dim]
    kjt = batch.sparse_features
    x, valid = left_pad(table[kjt[INPUT_KEY].values()], kjt[INPUT_KEY].lengths(), model.head.max_len)
    ts = padded_times(batch.timestamps, batch.target_timestamps, kjt[INPUT_KEY].lengths().long(), model.head.max_len)
    return model.head.encoder(x, ts, valid), valid, table


@pytest.mark.parametrize("norm_first", [False, True])
def test_sasrec_encoder_masks_padding_only_at_its_input_as_the_reference_does(norm_first):
    """The reference implementation zeroes padded positions once (their embedding rows are
    zero) and masks nothing else but the future: its blocks run on every position."""
    from recsys_pipe.models.sasrec import SASRecEncoder

    torch.manual_seed(0)
    cfg = SASRecConfig(embedding_dim=8, max_seq_len=6, num_heads=2, dropout=0.5, norm_first=norm_first)
    encoder = SASRecEncoder(cfg).eval()
    valid = torch.tensor([[False, False, True, True, True, True], [False, False, False, False, True, True]])
    items = torch.randn(2, 6, 8)
    positions = torch.arange(1, 7)[None, :] * valid
    x = (items * 8**0.5 + encoder.position(positions)) * valid[..., None]
    for block in encoder.blocks:
        x = block(x, encoder.causal)
    expected = encoder.final_norm(x)
    out = encoder(items, torch.zeros(2, 6), valid)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("norm_first", [False, True])
def test_sasrec_blocks_compute_the_chosen_layout(norm_first):
    from recsys_pipe.models.sasrec import SASRecBlock

    torch.manual_seed(0)
    block = SASRecBlock(8, 2, 0.5, norm_first).eval()  # eval: no dropout
    x = torch.randn(3, 5, 8)
    causal = ~torch.ones(5, 5, dtype=torch.bool).tril()

    def attend(q, kv):
        return block.attention(q, kv, kv, attn_mask=causal, need_weights=False)[0]

    ln_a, ln_f, ffn = block.attention_norm, block.forward_norm, block.feed_forward
    if norm_first:  # x + Attn(LN(x)), then + FFN(LN(.))
        h = x + attend(ln_a(x), ln_a(x))
        expected = h + ffn(ln_f(h))
    else:  # the paper's code: normalised query, raw keys/values, post-LN feed-forward
        q = ln_a(x)
        h = ln_f(q + attend(q, x))
        expected = h + ffn(h)
    # (1e-6: torch takes its fused self-attention path when query, key and value are one tensor)
    torch.testing.assert_close(block(x, causal), expected, rtol=1e-6, atol=1e-6)
    other = SASRecBlock(8, 2, 0.5, not norm_first).eval()
    other.load_state_dict(block.state_dict())
    assert not torch.allclose(other(x, causal), expected)  # the two layouts differ


def _model_id(cfg) -> str:
    return f"{cfg.name}-{cfg.loss}" + (f"-{cfg.negatives}" if cfg.loss == "sampled_softmax" else "")


@pytest.mark.parametrize("cfg", MODELS, ids=_model_id)
def test_losses_match_their_definitions(tmp_path, cfg):
    data = SequencesDataConfig(path=str(_pairs(tmp_path)), batch_size=8, max_seq_len=20, eval_negatives=5)
    data = cfg.data_for_model(data)  # the negatives per target the loss needs
    ds = data.dataset(0, 1)
    torch.manual_seed(0)
    model = cfg.build(ds.spec)
    batch = next(iter(make_dataloader(data)))
    if cfg.loss == "sampled_softmax":
        batch = with_collisions(batch, data.negatives_per_target)
    loss, out = model(batch)
    h, valid, table = _vectors(model, batch)
    q = h[valid]
    kjt = batch.sparse_features
    pos, neg = kjt[POS_KEY].values(), batch.negatives_per_position()
    if cfg.loss == "bce":
        sp = (q * table[pos]).sum(-1)
        sn = (q * table[neg]).sum(-1)
        expected = (-torch.log(torch.sigmoid(sp)) - torch.log(1 - torch.sigmoid(sn))).mean()
    elif cfg.negatives == "per_position":  # position t: its own K negatives, neg[t * K : (t + 1) * K]
        k = cfg.num_negatives
        assert neg.numel() == k * len(q)
        terms = []
        for t in range(len(q)):
            own = neg[t * k : (t + 1) * k]
            vectors = torch.nn.functional.normalize(table[torch.cat([pos[t : t + 1], own])], dim=-1)
            logits = vectors @ torch.nn.functional.normalize(q[t], dim=-1) / cfg.temperature
            logits[1:][own == pos[t]] = -math.inf
            terms.append(-torch.log_softmax(logits, dim=0)[0])
        expected = torch.stack(terms).mean()
    else:
        qn = torch.nn.functional.normalize(q, dim=-1)
        pool = neg[: cfg.num_negatives]
        logits = (
            torch.cat(
                [
                    (qn * torch.nn.functional.normalize(table[pos], dim=-1)).sum(-1, keepdim=True),
                    qn @ torch.nn.functional.normalize(table[pool], dim=-1).T,
                ],
                dim=1,
            )
            / cfg.temperature
        )
        logits[:, 1:][pos[:, None] == pool[None, :]] = -math.inf
        expected = torch.nn.functional.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert out["logits"].shape == out["labels"].shape == (2 * len(q), 1)
    assert float(out["num_tokens"]) == len(q) == int(batch.num_loss_tokens())
    loss.backward()


@pytest.mark.parametrize(
    ("overrides", "per_target"),
    [
        (["model=hstu_retrieval", "model.num_negatives=9"], 9),  # the reference's recipe: its own per position
        (["model=hstu_retrieval", "model.num_negatives=9", "model.negatives=shared"], 1),
        (["model=sasrec", "model.num_negatives=9"], 1),  # bce: one per position
        (["model=hstu_retrieval", "model.num_negatives=9", "data=parquet_sequences"], 9),
    ],
)
def test_the_run_config_derives_the_negatives_the_data_draws_per_target(tmp_path, overrides, per_target):
    """`model.*` alone sets how many negatives per target the data draws: no data key repeats it."""
    from recsys_pipe.testing import load_run

    run = load_run(
        *(overrides if "data=parquet_sequences" in overrides else ["data=sequences", *overrides]),
        f"data.path={_pairs(tmp_path)}",
    )
    assert run.data.negatives_per_target == per_target
    with pytest.raises(ValidationError, match="negatives_per_target"):  # no key of the data's
        SequencesDataConfig(path=str(_pairs(tmp_path)), negatives_per_target=9)


def test_per_position_batches_look_each_negative_up_once_and_select_and_join(tmp_path):
    """Several negatives per target: the KJT holds the batch's distinct negatives (each looked up
    once) and `neg_index` every position's own; `select` and `concat` (microbatches, the batch
    shuffler) keep every sample's negatives, position by position."""
    data = SequencesDataConfig(path=str(_pairs(tmp_path)), max_seq_len=20, eval_negatives=5)
    data = data.with_negatives_per_target(4)
    ds = data.dataset(0, 1)
    samples = [ds[i] for i in range(6)]
    batch = collate_retrieval(samples)
    distinct = batch.sparse_features[NEG_KEY].values()
    assert torch.equal(distinct, torch.unique(distinct)) and distinct.numel() < batch.neg_index.numel()
    assert batch.negatives_per_position().tolist() == [n for s in samples for n in s.negatives]
    picked = batch.select(torch.tensor([4, 1]))
    assert picked.negatives_per_position().tolist() == [*samples[4].negatives, *samples[1].negatives]
    joined = type(batch).concat([picked, batch.select(torch.tensor([0]))])
    assert joined.negatives_per_position().tolist() == [
        *samples[4].negatives,
        *samples[1].negatives,
        *samples[0].negatives,
    ]
    again = collate_retrieval([samples[i] for i in (4, 1, 0)])
    assert torch.equal(joined.sparse_features.values(), again.sparse_features.values())
    assert torch.equal(joined.neg_index, again.neg_index)


def test_a_batch_fetch_draws_what_each_sample_draws_alone(tmp_path):
    """`__getitems__` (the DataLoader's batch fetch: one draw for the batch) gives every sample
    the negatives it gets fetched alone, across an epoch boundary and with a user twice."""
    ds = SequencesDataset(read_interactions(_pairs(tmp_path)), max_seq_len=5, eval_negatives=5)
    ds.negatives_per_target = 3
    indices = [len(ds) - 1, 2, len(ds) + 2, 0]
    for index, sample in zip(indices, ds.__getitems__(indices), strict=True):
        alone = ds[index]
        assert sample.negatives.tolist() == alone.negatives.tolist() and len(alone.negatives) == 3 * len(alone.targets)
        assert (sample.sample_id, sample.inputs, sample.targets) == (alone.sample_id, alone.inputs, alone.targets)


def test_gathered_scores_gradients_match_finite_differences():
    """The per-position scores' own backward (chunked, `index_add_` into the rows) against
    autograd's finite differences, with repeated rows and chunks that do not divide the positions."""
    g = torch.Generator().manual_seed(0)
    query = torch.randn(7, 3, dtype=torch.float64, generator=g, requires_grad=True)
    rows = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    index = torch.randint(0, 5, (7, 4), generator=g)
    with mock.patch.dict("recsys_pipe.models.retrieval._SCORE_CHUNK_FLOATS", cpu=24):  # chunks of 2 positions
        expected = torch.einsum("td,tkd->tk", query, rows[index])
        torch.testing.assert_close(gathered_scores(query, rows, index), expected)
        assert torch.autograd.gradcheck(lambda q, r: gathered_scores(q, r, index), (query, rows))


def test_per_position_negatives_refuse_a_batch_with_too_few(tmp_path):
    """A batch whose source drew one negative per target (built without the model's derivation)
    stops the per-position loss with a message that says what is missing."""
    cfg = HSTURetrievalConfig(embedding_dim=16, max_seq_len=20, dropout=0.0, num_negatives=6)
    data = SequencesDataConfig(path=str(_pairs(tmp_path)), batch_size=8, max_seq_len=20, eval_negatives=5)
    torch.manual_seed(0)
    model = cfg.build(data.dataset(0, 1).spec)
    with pytest.raises(ValueError, match="needs 6 negatives per target"):
        model(next(iter(make_dataloader(data))))


@pytest.mark.parametrize("cfg", MODELS[:3], ids=_model_id)
def test_evaluation_ranks_count_the_candidates_scored_above(tmp_path, cfg):
    data = SequencesDataConfig(path=str(_pairs(tmp_path)), batch_size=8, max_seq_len=20, eval_negatives=9)
    ds = data.dataset(0, 1)
    torch.manual_seed(1)
    model = cfg.build(ds.spec).eval()
    split = ds.split("test", 8)
    batch = split.collate([split[i] for i in range(8)])
    with torch.no_grad():
        _, out = model(batch)
        h, _, table = _vectors(model, batch)
    query = h[:, -1]
    if cfg.loss == "sampled_softmax":
        query, table = (torch.nn.functional.normalize(v, dim=-1) for v in (query, table))
    scores = query @ table.T  # [B, items]
    for b in range(8):
        cands = split[b].candidates
        held_out = scores[b, cands[0]]
        assert int(out["rank_sampled"][b]) == int((scores[b, cands[1:]] > held_out).sum())
        assert int(out["rank_full"][b]) == int((scores[b] > held_out).sum())  # history included
    assert (out["rank_full"] >= out["rank_sampled"]).all()


# -- metrics ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_metrics_match_torchmetrics_retrieval_metrics(seed):
    g = torch.Generator().manual_seed(seed)
    queries, candidates = 300, 250  # > 200 candidates so that K=200 is not everything
    # positive scores: torchmetrics' reciprocal rank counts an item relevant only if its score is > 0
    scores = torch.rand(queries, candidates, generator=g) + 0.01
    relevant = torch.randint(0, candidates, (queries,), generator=g)
    target = torch.zeros(queries, candidates, dtype=torch.bool)
    target[torch.arange(queries), relevant] = True
    ranks = (scores > scores[torch.arange(queries), relevant][:, None]).sum(dim=1)
    ours = retrieval_metrics(ranks)
    indexes = torch.arange(queries)[:, None].expand(-1, candidates).reshape(-1)
    flat = (scores.reshape(-1), target.reshape(-1), indexes)
    for k in KS:
        assert ours[f"HR@{k}"] == pytest.approx(float(RetrievalHitRate(top_k=k)(*flat)), abs=1e-6)
        assert ours[f"NDCG@{k}"] == pytest.approx(float(RetrievalNormalizedDCG(top_k=k)(*flat)), abs=1e-6)
    assert ours["MRR"] == pytest.approx(float(RetrievalMRR()(*flat)), abs=1e-6)
    assert 0 < ours["HR@10"] < ours["HR@50"] < ours["HR@200"] < 1


# -- end to end -----------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["sasrec", "hstu_retrieval"])
def test_recsys_train_logs_metrics_that_the_dump_recomputes(tmp_path, model):
    path = _pairs(tmp_path, users=80)
    dump = tmp_path / "dump.csv"
    code = train_cli.run(
        [
            "data=sequences",
            f"data.path={path}",
            "data.batch_size=16",
            "data.eval_negatives=20",
            f"model={model}",
            "pipeline=hstu_prefetch",
            "trainer.device=cpu",
            "trainer.max_steps=null",
            "trainer.epochs=3",
            "trainer.eval_every=1000",
            "trainer.progress_bar=false",
            f"trainer.eval_dump={dump}",
            "model.num_negatives=32",  # sampled_softmax (hstu_retrieval): at most the 39 other items
            f"trainer.output_dir={tmp_path}/runs",
        ]
    )
    assert code == 0
    (run_dir,) = (tmp_path / "runs" / "recsys-train").iterdir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "test" in r]
    assert len(evals) == 4  # before step 1 and after each of 3 epochs
    selected = [r for r in evals if r.get("selected")][-1]
    best = max(r["valid"]["sampled"]["HR@10"] for r in evals)
    assert selected["valid"]["sampled"]["HR@10"] == best  # validation picks what the dump holds
    with dump.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["user", "item", "rank_sampled", "rank_full"]
    assert len(rows) == selected["users"]["test"]
    data = read_interactions(path)
    last = {str(u): str(items[-1]) for u, items in zip(data.users, data.items) if len(items) >= 3}
    assert {r["user"]: r["item"] for r in rows} == last  # raw ids as in the file, the test item
    for protocol, column in (("sampled", "rank_sampled"), ("full", "rank_full")):
        ranks = torch.tensor([int(r[column]) for r in rows])
        recomputed = retrieval_metrics(ranks)
        for name, value in selected["test"][protocol].items():
            assert recomputed[name] == value, (protocol, name)


def test_retrieval_records_reach_metrics_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from recsys_pipe.train.metrics import MetricsWriter

    ranks = torch.tensor([0, 3, 12, 60, 250])
    record = {
        "step": 7,
        "valid": {"sampled": retrieval_metrics(ranks)},
        "test": {"sampled": retrieval_metrics(ranks), "full": retrieval_metrics(ranks * 10)},
        "users": {"valid": 5, "test": 5},
    }
    writer = MetricsWriter(str(tmp_path))
    writer.write(record)
    writer.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == record
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"eval/valid/sampled/HR@10", "eval/test/full/NDCG@200", "eval/test/sampled/MRR"} <= tags
    (point,) = events.Scalars("eval/test/full/HR@50")
    assert point.step == 7 and point.value == pytest.approx(record["test"]["full"]["HR@50"])


def test_an_eval_dump_without_a_retrieval_source_is_refused(tmp_path, capsys):
    code = train_cli.run(
        [
            "pipeline=serial",
            "trainer.device=cpu",
            f"trainer.eval_dump={tmp_path}/d.csv",
            "trainer.max_steps=1",
            f"trainer.output_dir={tmp_path}/runs",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "trainer.eval_dump: data source 'synthetic' has no retrieval evaluation to dump" in err


@pytest.mark.parametrize(
    "overrides, path, fragment",
    [
        (["model=sasrec", "data=synthetic"], "data.name", "model 'sasrec' needs data=sequences, got 'synthetic'"),
        (["model=sasrec"], "data.path", "missing required value"),  # data=sequences is its default
        (["model=hstu_retrieval", "data=sequences", "model.max_seq_len=20"], "data.max_seq_len", "exceeds"),
        (
            ["model=sasrec", "data=synthetic", "model.embedding_dim=50", "model.num_heads=3"],
            "model.num_heads",
            "not divisible",
        ),
    ],
)
def test_model_and_data_mismatches_are_config_errors(tmp_path, overrides, path, fragment):
    from recsys_pipe.testing import load_run

    data = _pairs(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_run(*overrides, *([f"data.path={data}"] if "data=sequences" in overrides else []))
    assert any(p.path == path and fragment in p.message for p in info.value.problems), info.value


# -- the reproduction script --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reproduce_games_script_prints_the_table_and_one_json_line(tmp_path):
    """scripts/reproduce_games.sh end to end on a small "user item" file (2 ranks, 1 SASRec
    epoch, 1 HSTU epoch): the published rows beside ours, the full-corpus rows, the plot, and a
    last line of JSON whose dumps recompute its metrics."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    data = _pairs(tmp_path, users=300, items=200)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "SASREC_EPOCHS": "1",
        "HSTU_EPOCHS": "1",
        "EVAL_EPOCHS": "1",
        "EXTRA": "trainer.tensorboard=false",
    }
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "reproduce_games.sh"), str(data), str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    for row in ("paper                   0.7410   0.5360", "pmixer                  0.7318   0.5308"):
        assert row in lines
    # the epoch validation picks: before training (0) or after the one epoch (1)
    selected = re.compile(r"ours sasrec +[0-9.]+ +[0-9.]+ +epoch [01]\.0 \(best validation HR@10 of 1 evaluations\)")
    assert any(selected.match(line) for line in lines), lines
    assert any(line.startswith("ours hstu full") for line in lines)
    summary = json.loads(lines[-1])
    for model in ("sasrec", "hstu"):
        assert set(summary[model]["sampled"]) == {f"{m}@{k}" for m in ("HR", "NDCG") for k in KS} | {"MRR"}
        assert summary[model]["full"]["HR@10"] <= summary[model]["sampled"]["HR@10"]
        assert summary["dump_recomputes"][model] == [True, True]
        assert Path(summary["dump"][model]).read_text().startswith("user,item,rank_sampled,rank_full\n")
        assert summary["train_s"][model] >= 1
    assert (out / "hr10_vs_epoch.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(300)
def test_a_resumed_run_keeps_the_best_validation_choice(tmp_path):
    """The checkpoint holds the best validation HR@10 so far (it picks what eval_dump holds), so a
    run resumed from it selects exactly the evaluations the uninterrupted run selects."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from recsys_pipe.train.trainer import EVAL_BEST_KEY

    path = _pairs(tmp_path, users=80)
    common = [
        "data=sequences",
        f"data.path={path}",
        "data.batch_size=16",
        "data.eval_negatives=20",
        "model=sasrec",
        "pipeline=serial",
        "trainer.device=cpu",
        "trainer.max_steps=null",
        "trainer.epochs=4",
        "trainer.eval_every=2",
        "trainer.progress_bar=false",
        "trainer.tensorboard=false",
        "trainer.checkpoint.interval=4",
        "trainer.checkpoint.keep_latest=0",
    ]

    def evals(run_dir: Path) -> dict[int, dict]:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in records if "test" in r}

    assert train_cli.run([*common, f"trainer.eval_dump={tmp_path}/a.csv", f"trainer.output_dir={tmp_path}/a"]) == 0
    (run_dir,) = (tmp_path / "a" / "recsys-train").iterdir()
    ref = evals(run_dir)
    checkpoint = run_dir / "checkpoints" / "step_4"
    dcp_to_torch_save(checkpoint, tmp_path / "step_4.pt")
    saved = torch.load(tmp_path / "step_4.pt", weights_only=False)["train"]["progress"]["eval_best"]
    assert EVAL_BEST_KEY == "train.progress.eval_best"
    assert saved == max(r["valid"]["sampled"]["HR@10"] for step, r in ref.items() if step <= 4)
    args = [*common, f"trainer.eval_dump={tmp_path}/b.csv", f"trainer.output_dir={tmp_path}/b"]
    assert train_cli.run([*args, f"trainer.resume_from={checkpoint}"]) == 0
    (resumed_dir,) = (tmp_path / "b" / "recsys-train").iterdir()
    resumed = evals(resumed_dir)
    assert sorted(resumed) == [step for step in sorted(ref) if step > 4]
    assert {s: r.get("selected", False) for s, r in resumed.items()} == {
        s: ref[s].get("selected", False) for s in resumed
    }


@pytest.mark.timeout(120)
def test_reproduce_games_script_checks_its_inputs_first(tmp_path):
    """A missing data file: exit 2, one `error:` line, no run directory made, torchrun never started."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "reproduce_games.sh"), str(tmp_path / "Video.txt"), str(out)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"error: data.path: no such file: {tmp_path / 'Video.txt'}"]
    assert not out.exists() and "torchrun" not in proc.stdout + proc.stderr
