"""DLRM: the model protocol for torchrec's DLRM / DLRM_DCN and the plain-torch DLRM, the FX
contract torchrec's pipeline needs, config checks, and learning from a fresh `recsys-train`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torchmetrics.classification import BinaryAUROC
from torchrec.distributed.train_pipeline.tracing import Tracer

from recsys_pipe.config import ConfigError
from recsys_pipe.data import CriteoSyntheticDataConfig, make_dataloader
from recsys_pipe.models import DLRMConfig, DLRMDCNConfig, TorchDLRMConfig
from recsys_pipe.testing import fork_ranks, load_run

BIN = Path(sys.executable).parent
CONFIGS = {"dlrm": DLRMConfig, "dlrm_dcn": DLRMDCNConfig, "dlrm_torch": TorchDLRMConfig}


def _data(**kw):
    return CriteoSyntheticDataConfig(**{"batch_size": 32, "num_embeddings": 100, **kw})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_follows_the_model_protocol(name):
    data = _data()
    loader = make_dataloader(data)
    torch.manual_seed(0)
    model = CONFIGS[name]().build(data.spec())
    batch = next(iter(loader))
    loss, outputs = model(batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert outputs["logits"].shape == outputs["labels"].shape == (32, 1) and not outputs["logits"].requires_grad
    assert torch.allclose(outputs["loss_sum"] / 32, loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_fx_trace_finds_the_embedding_bag_input_as_a_batch_attribute():
    """What torchrec's _rewrite_model relies on: the EBC is called on `batch.sparse_features`."""
    data = _data()
    model = DLRMConfig().build(data.spec())
    ebc = "model.sparse_arch.embedding_bag_collection"
    graph = Tracer(leaf_modules=[ebc, "model.dense_arch", "model.over_arch", "model.inter_arch"]).trace(model)
    (call,) = [n for n in graph.nodes if n.op == "call_module" and n.target == ebc]
    (arg,) = call.args
    assert arg.op == "call_function" and arg.target is getattr and arg.args[1] == "sparse_features"
    assert arg.args[0].op == "placeholder"


def test_layer_sizes_and_data_are_checked():
    with pytest.raises(ValidationError, match="dense_arch_layer_sizes must end with embedding_dim .16."):
        DLRMConfig(dense_arch_layer_sizes=[64, 8])
    with pytest.raises(ConfigError) as info:
        load_run("model=dlrm", "data=synthetic")
    assert (
        "model 'dlrm' needs tabular data (criteo, criteo_synthetic, parquet, or a source whose config derives from "
        "recsys_pipe.data.TabularDataConfig), got 'synthetic'"
    ) in str(info.value)
    assert isinstance(load_run("model=dlrm").data, CriteoSyntheticDataConfig)  # its default data source


def test_plain_torch_dlrm_learns_the_generated_clicks():
    data = _data(batch_size=128, num_embeddings=200)
    loader = make_dataloader(data)
    torch.manual_seed(0)
    model = TorchDLRMConfig().build(data.spec())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    auc, losses = BinaryAUROC(), []
    for step, batch in zip(range(150), loader):
        loss, outputs = model(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step >= 120:
            auc.update(outputs["logits"][:, 0], outputs["labels"][:, 0].long())
    assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20 - 0.03
    assert float(auc.compute()) > 0.68


@pytest.mark.timeout(300)
def test_fresh_recsys_train_dlrm_loss_falls_and_auc_rises(tmp_path):
    """`recsys-train model=dlrm data=criteo_synthetic` as a user first runs it (one rank, forked:
    `fork_ranks`)."""
    proc = fork_ranks(
        BIN / "recsys-train",
        "model=dlrm",
        "data=criteo_synthetic",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        "trainer.max_steps=150",
        "trainer.eval_every=150",
        f"trainer.output_dir={tmp_path}/runs",
        nproc=1,
        timeout=250,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = (tmp_path / "runs").glob("recsys-train/*/metrics.jsonl")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [r for r in records if "auc" in r]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [e["step"] for e in evals] == [0, 150]
    assert evals[-1]["auc"] > evals[0]["auc"] + 0.08 and evals[-1]["log_loss"] < evals[0]["log_loss"]
    assert sum(losses[-3:]) < sum(losses[:3])
