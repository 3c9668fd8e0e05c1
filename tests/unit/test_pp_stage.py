"""The stage runtime's backward split and the placement-independent dropout, in one process."""

import pytest
import torch
from torch import nn

from recsys_pipe.models.dropout import microbatch_seed, seeded_dropout
from recsys_pipe.pp import ChainedStages, StageRuntime
from recsys_pipe.pp.p2p import PeerLink


class Block(nn.Module):
    def __init__(self, first, last, layer):
        super().__init__()
        self.first, self.last = first, last
        self.linear = nn.Linear(8, 8)
        self.drop = seeded_dropout(0.3, layer=layer)

    def forward(self, batch, inputs):
        h = self.drop(torch.tanh(self.linear(batch["x"] if self.first else inputs[0])))
        return ((h - batch["y"]) ** 2).mean() if self.last else h


def _batch():
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 8, generator=g)}


def _last_stage():
    torch.manual_seed(0)
    module = Block(first=False, last=True, layer=1)
    return module, StageRuntime(module, 1, 2, prev_rank=0, link=PeerLink())


def test_b_computes_only_the_input_gradient_and_w_the_weights_bitwise_as_a_full_backward():
    module, runtime = _last_stage()
    h = torch.randn(4, 8, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    record = runtime.forward(0, _batch(), (h,))
    after_b = runtime.backward_input(record)
    assert all(p.grad is None for p in module.parameters()), "B must leave the weight gradients to W"
    assert after_b.input_grads[0].shape == h.shape
    runtime.backward_weight(after_b)
    split = [p.grad.clone() for p in module.parameters()]

    module2, runtime2 = _last_stage()
    h2 = h.detach().clone().requires_grad_(True)
    full = runtime2.backward(runtime2.forward(0, _batch(), (h2,)))
    assert all(torch.equal(a, p.grad) for a, p in zip(split, module2.parameters(), strict=True))
    assert torch.equal(after_b.input_grads[0], full.input_grads[0])
    assert after_b.forward.loss is not None and after_b.forward.loss.dim() == 0


def test_first_stage_runs_the_whole_backward_in_w():
    torch.manual_seed(0)
    module = ChainedStages([Block(True, False, 0), Block(False, True, 1)])
    runtime = StageRuntime(module, 0, 1)
    after_b = runtime.backward_input(runtime.forward(0, _batch()))
    assert all(p.grad is None for p in module.parameters())
    runtime.backward_weight(after_b)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())


def test_scale_grads_divides_by_the_microbatch_count():
    module, runtime = _last_stage()
    for p in module.parameters():
        p.grad = torch.full_like(p, 6.0)
    runtime.scale_grads(4)
    assert all(torch.equal(p.grad, torch.full_like(p, 1.5)) for p in module.parameters())


def test_last_stage_must_return_a_scalar_loss():
    class NoLoss(nn.Module):
        def forward(self, batch, inputs):
            return batch

    runtime = StageRuntime(NoLoss(), 0, 1)
    with pytest.raises(ValueError, match="last stage must return its loss"):
        runtime.forward(0, torch.ones(3))


def test_dropout_mask_depends_on_step_microbatch_and_layer_only():
    x = torch.ones(64, 64)

    def mask(step, mb, layer):
        with microbatch_seed(step, mb):
            return seeded_dropout(0.5, layer)(x)

    assert torch.equal(mask(1, 2, 3), mask(1, 2, 3))
    for other in [(2, 2, 3), (1, 3, 3), (1, 2, 4)]:
        assert not torch.equal(mask(1, 2, 3), mask(*other)), other
    kept = mask(0, 0, 0)
    assert set(kept.unique().tolist()) == {0.0, 2.0}


def test_dropout_refuses_to_draw_outside_a_microbatch_key_and_is_identity_in_eval():
    drop = seeded_dropout(0.5, layer=0)
    with pytest.raises(RuntimeError, match="outside microbatch_seed"):
        drop(torch.ones(3))
    drop.eval()
    assert torch.equal(drop(torch.ones(3)), torch.ones(3))


def test_stage_neighbours_are_checked():
    with pytest.raises(ValueError, match="only the end stages have no neighbour"):
        StageRuntime(nn.Identity(), 1, 3, prev_rank=0, link=PeerLink())
    with pytest.raises(ValueError, match="needs a PeerLink"):
        StageRuntime(nn.Identity(), 0, 2, next_rank=1)


@pytest.mark.parametrize(("use_user", "relative_bias"), [(False, True), (True, True), (True, False)])
def test_hstu_split_into_stages_computes_the_models_loss_and_gradients_bitwise(use_user, relative_bias):
    from recsys_pipe.data import SyntheticConfig, SyntheticDataConfig, make_dataloader
    from recsys_pipe.models import HSTUConfig, build_hstu
    from recsys_pipe.models.hstu_cut import hstu_stages

    synthetic = SyntheticConfig(num_items=100, num_users=50, num_clusters=4)
    data = SyntheticDataConfig(
        batch_size=8, max_seq_len=12, num_candidates=3, use_user_feature=use_user, synthetic=synthetic
    )
    loader = make_dataloader(data)
    torch.manual_seed(0)
    model = build_hstu(HSTUConfig(max_seq_len=12, relative_bias=relative_bias, num_layers=3), loader.dataset.spec)
    batch = next(iter(loader))
    loss, _ = model(batch)
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    stages = hstu_stages(model, [[0], [1, 2]])
    assert torch.equal(ChainedStages(stages)(batch, ()), loss)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is None}  # before backward: none
    assert len(got) == len(list(model.parameters()))
    ChainedStages(stages)(batch, ()).backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in got)
    # every parameter lives on exactly one stage: the embeddings and bias first, the head last
    owners = [{id(p) for p in stage.parameters()} for stage in stages]
    assert not owners[0] & owners[1] and len(owners[0] | owners[1]) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="layers 0..2 in order"):
        hstu_stages(model, [[0, 2], [1]])


def _assert_stages_compute_the_model(model, stages, batch, key=(2, 0)):
    """The two stages chained on one rank under microbatch key `key` give the model's loss and
    gradients bitwise (the same keyed dropout masks), every parameter on exactly one stage and
    the item table on the first; returns the loss."""
    with microbatch_seed(*key):
        expected_loss, _ = model(batch)
    expected_loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with microbatch_seed(*key):
        got_loss = ChainedStages(stages)(batch, ())
    got_loss.backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert torch.equal(got_loss, expected_loss)
    assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in got)
    assert {id(p) for p in stages[0].parameters()} >= {id(p) for p in model.ec.parameters()}  # the table: first
    owners = [{id(p) for p in stage.parameters()} for stage in stages]  # each parameter on one stage
    assert not owners[0] & owners[1] and len(owners[0] | owners[1]) == len(list(model.parameters()))
    return expected_loss


def _sequences_file(tmp_path):
    """A "user item" file: user u's items follow a chain (as test_retrieval's)."""
    g = torch.Generator().manual_seed(0)
    lines = []
    for u in range(1, 61):
        n, start = int(torch.randint(2, 15, (1,), generator=g)), int(torch.randint(0, 40, (1,), generator=g))
        lines += [f"{u * 7} {(start + k) % 40 + 100}" for k in range(n)]
    path = tmp_path / "seq.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(("dropout", "loss"), [(0.0, "bce"), (0.5, "bce"), (0.0, "sampled_softmax")])
def test_sasrec_split_into_stages_computes_the_models_loss_and_gradients_bitwise(tmp_path, dropout, loss):
    """Chained on one rank under one microbatch key: the keyed dropout sites (the attention
    weights' too) draw the same masks in the model and in its stages."""
    from recsys_pipe.data import make_dataloader
    from recsys_pipe.data.in_memory.sequences import SequencesDataConfig
    from recsys_pipe.models.retrieval_cut import sasrec_stages
    from recsys_pipe.models.sasrec import SASRecConfig

    data = SequencesDataConfig(path=str(_sequences_file(tmp_path)), batch_size=8, max_seq_len=20, eval_negatives=5)
    torch.manual_seed(0)
    cfg = SASRecConfig(dropout=dropout, loss=loss, num_blocks=3, embedding_dim=16, max_seq_len=20)
    data = cfg.data_for_model(data)  # sampled_softmax: the negatives per target it scores
    model = cfg.build(data.dataset(0, 1).spec)
    batch = next(iter(make_dataloader(data)))
    stages = sasrec_stages(model, [[0], [1, 2]])  # keys the model's dropout sites too
    _assert_stages_compute_the_model(model, stages, batch)
    with pytest.raises(ValueError, match="blocks 0..2 in order"):
        sasrec_stages(model, [[0], [2, 1]])


@pytest.mark.parametrize(("dropout", "relative_bias"), [(0.3, True), (0.0, False)])
def test_hstu_retrieval_split_into_stages_computes_the_models_loss_and_gradients_bitwise(
    tmp_path, dropout, relative_bias
):
    """Chained on one rank under one microbatch key: the keyed dropout sites draw the same masks
    in the model and in its stages."""
    from recsys_pipe.data import make_dataloader
    from recsys_pipe.data.in_memory.sequences import SequencesDataConfig
    from recsys_pipe.models.retrieval_config import HSTURetrievalConfig
    from recsys_pipe.models.retrieval_cut import hstu_retrieval_stages

    data = SequencesDataConfig(path=str(_sequences_file(tmp_path)), batch_size=8, max_seq_len=20, eval_negatives=5)
    torch.manual_seed(0)
    cfg = HSTURetrievalConfig(
        dropout=dropout, relative_bias=relative_bias, num_layers=3, embedding_dim=16, max_seq_len=20
    )
    data = cfg.data_for_model(data)  # the negatives per target its loss scores
    model = cfg.build(data.dataset(0, 1).spec)
    batch = next(iter(make_dataloader(data)))
    stages = cfg.cut_into_stages(model, [[0, 1], [2]])  # as the config declares; keys the dropout sites too
    assert all(type(s).__name__ == "HSTURetrievalStage" for s in stages)
    expected_loss = _assert_stages_compute_the_model(model, stages, batch, key=(3, 1))
    if dropout:
        with microbatch_seed(3, 2):  # another microbatch: other masks
            assert not torch.equal(ChainedStages(stages)(batch, ()), expected_loss)
    with pytest.raises(ValueError, match="layers 0..2 in order"):
        hstu_retrieval_stages(model, [[1], [0, 2]])


def test_the_first_stages_tables_are_sharded_by_dmp_and_train_bitwise_as_plain_tables(gloo_world):
    """`build_pipelined_model` on one rank (`parallel.pp.size=1`, 2 microbatches): the first
    stage's collection is torchrec's `ShardedEmbeddingCollection` on the dense kernel (whatever
    `model.compute_kernel` says), its tables are the stage's `summed_params`, and 2 steps (Adam,
    dropout on) equal a plain loop over the unsharded model's stages: forward and backward per
    microbatch under its dropout key, gradients / 2, one optimizer step."""
    from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbedding, BatchedDenseEmbedding
    from torchrec.distributed.embedding import ShardedEmbeddingCollection

    from recsys_pipe.data import make_dataloader
    from recsys_pipe.pp.train import build_pipelined_model
    from recsys_pipe.runtime.distributed import DistInfo
    from recsys_pipe.testing import load_run
    from recsys_pipe.train.optim import dense_optimizer_factory

    overrides = ["parallel.pp.microbatches=2", "model.num_layers=2", "model.dropout=0.2", "data.batch_size=16"]
    run = load_run(*overrides, "model.compute_kernel=fused", "trainer.device=cpu")
    loader = make_dataloader(run.data)
    batches = [batch for _, batch in zip(range(2), loader)]
    pipelined = build_pipelined_model(run, DistInfo(0, 1, 0, torch.device("cpu"), "gloo"), run.data.spec())
    optimizer = dense_optimizer_factory(run.optimizer)(pipelined.parameters())
    ec = pipelined.stages["0"].ec
    assert isinstance(ec, ShardedEmbeddingCollection)
    kernels = [k for lookup in ec._lookups for k in lookup.modules() if isinstance(k, BaseBatchedEmbedding)]
    assert kernels and all(isinstance(k, BatchedDenseEmbedding) for k in kernels)
    runtime = pipelined.runner.runtimes[0]  # stage 0, the only one
    assert {id(p) for p in runtime.summed_params} == {id(p) for p in ec.parameters()} != set()
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        losses.append(pipelined(batch)[0].detach())
        optimizer.step()

    torch.manual_seed(run.seed)
    plain = ChainedStages(run.model.cut_into_stages(run.model.build(run.data.spec()), [[0, 1]]))
    plain_optimizer = dense_optimizer_factory(run.optimizer)(plain.parameters())
    expected = []
    for step, batch in enumerate(batches):
        plain_optimizer.zero_grad()
        n, mb_losses = batch.sample_ids.shape[0], []
        for j in range(2):
            with microbatch_seed(step, j, run.seed):
                loss = plain(batch.select(torch.arange(j * n // 2, (j + 1) * n // 2)), ())
            loss.backward()
            mb_losses.append(loss.detach())
        for p in plain.parameters():
            p.grad.div_(2)
        plain_optimizer.step()
        expected.append(torch.stack(mb_losses).mean())
    assert [float(v) for v in losses] == [float(v) for v in expected]
    got, want = dict(pipelined.stages["0"].named_parameters()), dict(plain.stages[0].named_parameters())
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in got)


def test_reduce_grads_averages_all_but_the_summed_params(gloo_world):
    """As if a second replica had contributed zero gradients (`dp_size` 2 over this rank's
    group): the dense gradients are divided by 2, the sharded tables' (summed by their own
    backward) are left as they are."""
    dense, table = nn.Linear(2, 2), nn.Parameter(torch.ones(3, 2))
    module = nn.Module()
    module.dense, module.table = dense, table
    runtime = StageRuntime(module, 0, 1, dp_group=gloo_world, summed_params=[table])
    runtime.dp_size = 2
    for p in module.parameters():
        p.grad = torch.full_like(p, 4.0)
    runtime.reduce_grads()
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in dense.parameters())
    assert torch.equal(table.grad, torch.full((3, 2), 4.0))
