"""`model.compute_kernel=dense`: torchrec's dense kernel for every table, updated by the dense
optimizer. On CPU, sequence tables get the unpooled lookup (`models/cpu_dense_lookup.py`); a
table then trains bitwise like a plain `nn.Embedding` under the same torch optimizer."""

from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from recsys_pipe.cli.plan import run as plan_cli
from recsys_pipe.data import SyntheticDataConfig
from recsys_pipe.models import HSTUConfig
from recsys_pipe.models.cpu_dense_lookup import unpooled_dense_lookup
from recsys_pipe.models.sharding import make_optimizer, make_sharded_model, sharding_plan
from recsys_pipe.train.optim import AdamConfig, TrainOptimizer


def test_unpooled_lookup_returns_each_ids_row_and_its_gradient():
    """Two tables, three features (two share table 0), two bags each: one output row per id, in
    feature order, and the gradient lands on those rows of the one flat weight."""
    tbe = DenseTableBatchedEmbeddingBagsCodegen(
        [(10, 4), (7, 4)], feature_table_map=[0, 0, 1], pooling_mode=PoolingMode.NONE, use_cpu=True
    )
    tables = [tbe.weights.detach()[:40].view(10, 4), tbe.weights.detach()[40:].view(7, 4)]
    ids = {0: [[1, 2], [9]], 1: [[], [3, 3, 0]], 2: [[6], [0, 5]]}
    indices = torch.tensor([i for bags in ids.values() for bag in bags for i in bag])
    offsets = torch.tensor([0, *torch.tensor([len(b) for bags in ids.values() for b in bags]).cumsum(0).tolist()])
    out = unpooled_dense_lookup(tbe, indices, offsets)
    expected = torch.cat([tables[[0, 0, 1][f]][torch.tensor([i for b in bags for i in b])] for f, bags in ids.items()])
    assert torch.equal(out, expected)
    out.sum().backward()
    grad = tbe.weights.grad
    hits0 = torch.bincount(torch.tensor([1, 2, 9, 3, 3, 0]), minlength=10).float()
    hits1 = torch.bincount(torch.tensor([6, 0, 5]), minlength=7).float()
    assert torch.equal(grad[:40].view(10, 4), hits0[:, None].expand(10, 4))
    assert torch.equal(grad[40:].view(7, 4), hits1[:, None].expand(7, 4))


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
@pytest.mark.parametrize("kernel", ["fused", "dense"])
def test_hand_built_plans_put_the_tables_on_the_chosen_kernel(sharding, kernel):
    cfg = HSTUConfig(sharding=sharding, compute_kernel=kernel)
    with torch.device("meta"):
        model = cfg.build(SyntheticDataConfig().spec())
    plan = sharding_plan(model, cfg, 2, "cpu")
    kernels = {p.compute_kernel for module in plan.plan.values() for p in module.values()}
    assert kernels == {kernel}


def test_the_planner_with_the_dense_kernel_is_a_config_error(tmp_path, capsys):
    """torchrec's planner offers the dense kernel for data_parallel tables only."""
    code = plan_cli(["model.sharding=planner", "model.compute_kernel=dense", f"trainer.output_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[0].startswith("error: model: ") and "hand-built plan" in err[0]


class _Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name="item_rows", embedding_dim=4, num_embeddings=12, feature_names=["seq", "pos"])]
        )

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out = self.ec(kjt)
        return sum(((jt.values() - 0.5) ** 2).sum() for jt in out.values())


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_a_dense_kernel_table_trains_like_a_torch_embedding_under_adam(gloo_world, sharding):
    torch.manual_seed(0)
    module = _Tables()
    reference = nn.Embedding(12, 4)
    reference.weight.data.copy_(module.ec.embeddings["item_rows"].weight.data)
    cfg = HSTUConfig(sharding=sharding, compute_kernel="dense")
    model = make_sharded_model(module, cfg, gloo_world, torch.device("cpu"))
    adam = AdamConfig(lr=0.01, betas=(0.9, 0.98), clip_grad_norm=1.0)
    optimizer = TrainOptimizer(make_optimizer(model, adam.build), adam, total_steps=3, model=model)
    torch_adam = torch.optim.Adam(reference.parameters(), lr=0.01, betas=(0.9, 0.98), fused=True)  # as optimizer=adam
    assert list(optimizer.sharded_tables) == ["ec.embeddings.item_rows.weight"]
    assert optimizer.dense_params == []  # a table's gradient is never clipped (its rows are per rank)
    for step in range(3):
        values = torch.randint(0, 12, (9,), generator=torch.Generator().manual_seed(step))
        kjt = KeyedJaggedTensor.from_lengths_sync(["seq", "pos"], values, torch.tensor([2, 3, 0, 1, 1, 2]))
        optimizer.zero_grad()
        model(kjt).backward()
        optimizer.step()
        torch_adam.zero_grad()
        ((reference(values) - 0.5) ** 2).sum().backward()
        torch_adam.step()
    (table,) = [v for k, v in model.state_dict().items() if k.endswith("item_rows.weight")]
    assert torch.equal(table.local_shards()[0].tensor, reference.weight.data)
    state = optimizer.state_dict()["optimizer"]["state"]["ec.embeddings.item_rows.weight"]
    assert torch.equal(state["exp_avg"].local_shards()[0].tensor, torch_adam.state[reference.weight]["exp_avg"])
