"""Separate random streams: dropout draws from a generator of its own, evaluation runs on a
stream of its own, so evaluating (at any cadence) leaves every training loss bitwise unchanged;
the dropout generator is checkpointed, so a resume with dropout continues bitwise.

Tolerance: bitwise (CPU kernels are deterministic): a loss that differs in any bit drew
another dropout mask. Every run trains with dropout > 0, or the comparisons could not fail.
"""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch
from _process_group import one_rank_group
from torch import nn

from recsys_pipe.testing import built_trainer, fit_run, load_run
from recsys_pipe.train import resolve_resume

STEPS = 6
COMMON = [
    "pipeline=serial",
    "trainer=smoke",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every=100",
    "trainer.tensorboard=false",
    "model.dropout=0.3",
]
SYNTHETIC = ["data.batch_size=8", "data.num_batches=8"]
#: the models with dropout, on small data; sasrec also on torchrec's dense kernel and a threaded plan
MODELS = {
    "sasrec": ["model=sasrec"],
    "sasrec/dense_kernel": ["model=sasrec", "model.compute_kernel=dense", "model.sharding=row_wise"],
    "sasrec/hstu_prefetch": ["model=sasrec", "pipeline=hstu_prefetch"],
    "hstu_retrieval": ["model=hstu_retrieval"],
    "hstu_small": ["model=hstu_small", *SYNTHETIC],
}


@pytest.fixture(scope="module")
def info():
    """A 1-rank process group for the module."""
    with one_rank_group() as info:
        yield info


@pytest.fixture(scope="module")
def sequences(tmp_path_factory) -> list[str]:
    """`data=sequences` overrides for a small "user item" file (learnable chains)."""
    g = torch.Generator().manual_seed(0)
    lines = []
    for u in range(1, 61):
        n = int(torch.randint(3, 15, (1,), generator=g))
        start = int(torch.randint(0, 40, (1,), generator=g))
        lines += [f"{u} {(start + k) % 40 + 100}" for k in range(n)]
    path = tmp_path_factory.mktemp("seq") / "seq.txt"
    path.write_text("\n".join(lines) + "\n")
    return ["data=sequences", f"data.path={path}", "data.batch_size=8", "data.eval_negatives=10"]


def _overrides(name: str, sequences: list[str]) -> list[str]:
    return [*COMMON, *([] if name == "hstu_small" else sequences), *MODELS[name]]


# -- the dropout function and its generator -------------------------------------------------------


@pytest.mark.parametrize(
    ("keep", "bits", "threshold"),
    [(0.5, 8, 128), (0.75, 8, 192), (0.9, 32, round(0.9 * 2**32)), (1 - 1 / 1024, 16, 65536 - 64), (0.1, 32, None)],
)
def test_keep_mask_keeps_each_element_with_probability_keep_independently(keep, bits, threshold):
    """The mask's keep rate is `keep` (exact thresholds where `keep` allows), alike at every
    position of the random words (a biased byte, e.g. the top bit of `random_`'s default
    [0, 2**63) range, would show), and neighbouring elements are independent."""
    from recsys_pipe.models.dropout import _threshold, keep_mask

    got_bits, got_threshold = _threshold(keep)
    assert got_bits == bits and abs(got_threshold / 2**bits - keep) <= 2**-32
    if threshold is not None:
        assert got_threshold == threshold
    n = 1 << 20
    mask = keep_mask(torch.Size([n]), keep, torch.Generator().manual_seed(1), torch.device("cpu")).float()
    sigma = (keep * (1 - keep) / n) ** 0.5
    assert abs(mask.mean().item() - keep) < 5 * sigma
    per_slot = mask.view(-1, 64 // bits).mean(0)  # the rate of each position within a 64-bit word
    assert (per_slot - keep).abs().max().item() < 5 * sigma * (64 // bits) ** 0.5
    both = (mask[:-1] * mask[1:]).mean().item()  # neighbours kept together: keep**2 if independent
    assert abs(both - keep**2) < 5 * (keep**2 * (1 - keep**2) / n) ** 0.5


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_scales_kept_elements_and_draws_only_from_its_generator(p, dtype):
    """Kept elements are x / (1 - p), the others 0 (and so are their gradients); the same
    generator state draws the same mask, the global generator is never drawn from."""
    from recsys_pipe.models.dropout import dropout

    x = (torch.rand(37, 53) + 0.5).to(dtype).requires_grad_()
    state = torch.get_rng_state()
    got = dropout(x, p, torch.Generator().manual_seed(3))
    assert torch.equal(torch.get_rng_state(), state)
    kept = got != 0
    assert torch.equal(got[kept], x[kept] * torch.tensor(1 / (1 - p), dtype=dtype))
    got.sum().backward()
    assert torch.equal(x.grad, kept.to(dtype) / (1 - p))
    assert torch.equal(dropout(x, p, torch.Generator().manual_seed(3)), got)
    assert not torch.equal(dropout(x, p, torch.Generator().manual_seed(4)), got)
    assert dropout(x, 0.0, torch.Generator()) is x


def test_dropout_modules_are_identity_in_eval_and_restore_their_generator_state():
    from recsys_pipe.models.dropout import Dropout, DropoutRng

    model = nn.Sequential(Dropout(0.5), nn.Linear(4, 4), Dropout(0.2))
    rng = DropoutRng(7)
    assert rng.attach(model) == 2 and [m.site for m in model if isinstance(m, Dropout)] == [0, 1]
    x = torch.randn(16, 4)
    model(x)  # advances the stream
    saved = rng.state_dict()
    expected = [model(x) for _ in range(3)]
    restored = DropoutRng(7)
    restored.load_state_dict(saved)
    restored.attach(model)
    assert all(torch.equal(model(x), e) for e in expected)
    fresh = DropoutRng(7)
    fresh.attach(model)
    assert not torch.equal(model(x), expected[0])  # the state, not the seed, continues the stream
    model.eval()
    assert torch.equal(model(x), model[1](x))


def test_sasrec_attention_dropout_path_computes_multihead_attention():
    """The written-out attention of a training forward with attention dropout is
    `nn.MultiheadAttention`'s computation when no weight is dropped (p = 0 here)."""
    from recsys_pipe.models.sasrec import SASRecBlock

    torch.manual_seed(0)
    block = SASRecBlock(8, 2, 0.0)
    q, kv = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    causal = ~torch.ones(5, 5, dtype=torch.bool).tril()
    expected = block.attention(q, kv, kv, attn_mask=causal, need_weights=False)[0]
    torch.testing.assert_close(block._attend_with_dropout(q, kv, causal), expected, rtol=1e-6, atol=1e-6)


def test_every_shipped_models_dropout_draws_from_the_dropout_generator(sequences):
    """No shipped model has a dropout site that draws from torch's global generator: no
    `nn.Dropout`, no attention with built-in dropout; the DLRM variants have no dropout."""
    from recsys_pipe.models import MODELS as REGISTRY
    from recsys_pipe.models.dropout import Dropout

    options = {"hstu_small": [], "dlrm": [], "dlrm_dcn": [], "dlrm_torch": [], "sasrec": sequences}
    options["hstu_retrieval"] = sequences
    names, sites = set(), {}
    for option, data in options.items():
        run = load_run(f"model={option}", *data)
        if "dropout" in type(run.model).model_fields:
            run = load_run(f"model={option}", *data, "model.dropout=0.3")
        module = run.model.build(run.data.spec())
        names.add(run.model.name)
        assert not [m for m in module.modules() if type(m) is nn.Dropout], option
        assert not [m for m in module.modules() if isinstance(m, nn.MultiheadAttention) and m.dropout], option
        sites[option] = sum(isinstance(m, Dropout) for m in module.modules())
        assert (sites[option] > 0) == ("dropout" in type(run.model).model_fields), option
    assert names == set(REGISTRY.names)  # every registered model is checked
    assert sites["dlrm"] == sites["dlrm_dcn"] == sites["dlrm_torch"] == 0
    assert sites["sasrec"] > sites["hstu_retrieval"] > 1  # attention-weight dropout in SASRec's blocks


# -- training does not depend on evaluation --------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(MODELS))
def test_evaluating_at_any_cadence_leaves_every_training_loss_bitwise_unchanged(info, sequences, name):
    overrides = _overrides(name, sequences)
    never = fit_run(info, [*overrides, "trainer.eval_every=0"])
    often = fit_run(info, [*overrides, "trainer.eval_every=2"])
    assert len(never.losses) == len(often.losses) == STEPS
    assert not never.evals and [e["step"] for e in often.evals] == [0, 2, 4, 6]
    assert often.losses == never.losses


def test_evaluation_leaves_the_global_generators_as_it_found_them(info, sequences):
    overrides = [*_overrides("sasrec", sequences), "trainer.eval_every=0", "trainer.max_steps=2"]
    with built_trainer(info, overrides) as trainer:
        trainer.fit()
        before = torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=False)
        first = trainer.evaluate()
        after = torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=False)
        assert torch.equal(before[0], after[0]) and before[1] == after[1]
        assert np.array_equal(before[2]["state"]["key"], after[2]["state"]["key"])
        first.pop("selected")
        assert trainer.evaluate() == first  # the same stream at the same step


# -- checkpointed dropout stream -------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_resume_with_dropout_continues_bitwise_and_needs_the_dropout_state(info, sequences, tmp_path):
    overrides = [*_overrides("sasrec", sequences), "trainer.eval_every=2"]
    reference = fit_run(info, overrides)
    (tmp_path / "a").mkdir()
    first = fit_run(info, [*overrides, "trainer.max_steps=3", "trainer.checkpoint.interval=3"], run_dir=tmp_path / "a")
    checkpoint = resolve_resume(tmp_path / "a", "unused")
    second = fit_run(info, overrides, restore=str(checkpoint))
    assert first.losses + second.losses == reference.losses
    # negative control: the checkpoint without its dropout state resumes on a fresh dropout stream
    control = tmp_path / "control"
    shutil.copytree(checkpoint, control)
    rank_file = control / "rng" / "rank0.pt"
    state = torch.load(rank_file, weights_only=True)
    assert state.pop("dropout")
    torch.save(state, rank_file)
    fresh = fit_run(info, overrides, restore=str(control))
    assert fresh.losses[0] != reference.losses[3]
