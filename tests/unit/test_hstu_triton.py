"""The fused jagged HSTU attention (`recsys_pipe.models.hstu_triton`, `model.attention=triton`)
against the padded attention it replaces, on the CPU in Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 where no GPU is visible): outputs and every gradient within 1e-5
(float32) on jagged batches with empty, length-1 and full sequences, candidates, with and
without the relative position/time bias; 20 training steps of the model with each attention;
and the launcher's refusals. tests/cuda/test_cuda_hstu_triton.py runs the compiled kernels."""

from __future__ import annotations

import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="the Triton attention's tests need the triton package (test extra)")

from recsys_pipe.data import SyntheticConfig, SyntheticDataConfig, make_dataloader  # noqa: E402
from recsys_pipe.models import HSTUConfig, build_hstu  # noqa: E402
from recsys_pipe.models.hstu_attention import RelativeBias, attention_mask, padded_attention  # noqa: E402
from recsys_pipe.models.hstu_triton import INTERPRETED, bucket_bounds, jagged_hstu_attention, runs_on  # noqa: E402

pytestmark = pytest.mark.skipif(
    not runs_on(torch.device("cpu")), reason="the kernels were compiled for CUDA (TRITON_INTERPRET unset)"
)

N, HEADS, WIDTH = 40, 2, 16
#: empty, length 1 (a lone candidate), full (N), and in-between lengths; candidates at the end
LENGTHS = [0, 1, N, 17, 33, 5]
CANDIDATES = [0, 1, 3, 2, 0, 5]


def _batch(seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    total = int(offsets[-1])
    q, k, v = (torch.randn(total, HEADS, WIDTH, generator=gen, dtype=dtype).requires_grad_() for _ in range(3))
    return lengths, offsets, q, k, v


def _times_at_bucket_edges(total: int, bias: RelativeBias, seed: int) -> torch.Tensor:
    """Increasing timestamps whose neighbouring gaps sit on and next to the buckets' smallest
    gaps (where a `log` of another library would round into the neighbouring bucket)."""
    gen = torch.Generator().manual_seed(seed)
    bounds = bucket_bounds(bias.bucket_of_gap, bias.num_time_buckets, 0.301, torch.device("cpu"))[1:-1]
    edges = torch.cat([bounds - 1, bounds, bounds + 1, torch.tensor([0, 1, 2])])
    gaps = edges[torch.randint(0, edges.numel(), (total,), generator=gen)]
    return gaps.cumsum(0)


def _padded(q, k, v, lengths, offsets, candidates, bias, times):
    """The padded path of `HSTULayer` on the same q, k, v: pad, `padded_attention`, unpad."""
    total = q.shape[0]
    qkv = torch.cat([t.reshape(total, -1) for t in (q, k, v)], dim=-1)
    padded = torch.ops.fbgemm.jagged_to_padded_dense(qkv, [offsets], [N], 0.0)
    mask = attention_mask(lengths, candidates, N)
    full_bias = None if bias is None else bias(torch.ops.fbgemm.jagged_1d_to_dense(times, offsets, N, 0))
    out = padded_attention(padded, mask, full_bias, HEADS)
    return torch.ops.fbgemm.dense_to_jagged(out, [offsets])[0].view(total, HEADS, WIDTH)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no bias", "relative bias"])
@pytest.mark.parametrize("with_candidates", [False, True], ids=["no candidates", "candidates"])
def test_outputs_and_gradients_equal_the_padded_attention(with_bias: bool, with_candidates: bool) -> None:
    lengths, offsets, q, k, v = _batch(seed=1)
    candidates = torch.tensor(CANDIDATES) if with_candidates else torch.zeros_like(lengths)
    bias = times = None
    inputs = [q, k, v]
    if with_bias:
        torch.manual_seed(2)
        bias = RelativeBias(N, 16)
        with torch.no_grad():  # larger than the initialisation's N(0, 0.02), so that errors show
            bias.position.normal_(0.0, 0.5)
            bias.time.normal_(0.0, 0.5)
        times = _times_at_bucket_edges(q.shape[0], bias, seed=3)
        inputs += [bias.position, bias.time]
    out = jagged_hstu_attention(
        q, k, v, offsets, N, torch.tensor(CANDIDATES) if with_candidates else None,
        None if bias is None else bias.jagged(times),
    )  # fmt: skip
    ref = _padded(q, k, v, lengths, offsets, candidates, bias, times)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(ref, inputs, grad)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for name, a, b in zip(["dq", "dk", "dv", "dposition", "dtime"], got, want):
        assert b.abs().max() > 0.1, name  # the gradient is there to compare
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_bucket_bounds_are_the_smallest_gap_of_each_bucket() -> None:
    """`bucket_bounds` (what the kernels correct their `log` estimate against) holds, by torch's
    own bucket function, the smallest gap of each bucket b or above (equal bounds: buckets no
    integer gap falls in)."""
    bias = RelativeBias(4, 64)
    bounds = bucket_bounds(bias.bucket_of_gap, 64, 0.301, torch.device("cpu"))
    assert bounds[0] == 0 and bounds[-1] == torch.iinfo(torch.int64).max
    inner = bounds[1:-1]
    assert bool((inner[1:] >= inner[:-1]).all())
    targets = torch.arange(1, 65)
    assert bool((bias.bucket_of_gap(inner) >= targets).all())
    assert bool((bias.bucket_of_gap(inner - 1) < targets).all())


def test_training_with_triton_attention_follows_padded() -> None:
    """20 steps of the HSTU model (user token, candidates, relative bias) with each attention,
    from the same weights on the same batches: every loss within 1e-5."""
    synthetic = SyntheticConfig(num_items=60, num_users=20, num_clusters=3)
    data = SyntheticDataConfig(use_user_feature=True, synthetic=synthetic, batch_size=3, max_seq_len=10)
    batches = [b for _, b in zip(range(20), make_dataloader(data))]
    spec = make_dataloader(data).dataset.spec
    losses = {}
    for attention in ("padded", "triton"):
        torch.manual_seed(0)  # one block of one head keeps the interpreter's 20 steps short
        cfg = HSTUConfig(max_seq_len=10, attention=attention, embedding_dim=16, num_heads=1, num_layers=1)
        model = build_hstu(cfg, spec)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses[attention] = []
        for batch in batches:
            loss, _ = model(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[attention].append(loss.item())
    diffs = [abs(a - b) for a, b in zip(losses["padded"], losses["triton"])]
    assert max(diffs) < 1e-5, diffs
    assert losses["padded"][-1] < losses["padded"][0]  # it trained


# -- the launcher refuses what cannot run --------------------------------------------------------


def _refused(argv, tmp_path, capsys) -> str:
    from recsys_pipe.cli import train as train_cli

    code = train_cli.run([*argv, f"trainer.output_dir={tmp_path}/runs"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "runs" / "recsys-train").exists()
    return lines[0]


def test_triton_on_the_cpu_without_the_interpreter_exits_2(tmp_path, capsys, monkeypatch, no_process_group):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    line = _refused(["model.attention=triton", "trainer.device=cpu"], tmp_path, capsys)
    assert line.startswith("error: model.attention: triton runs its kernels on CUDA, and this run trains on cpu")


def test_triton_without_the_package_exits_2(tmp_path, capsys, monkeypatch, no_process_group):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    line = _refused(["model.attention=triton"], tmp_path, capsys)
    assert line.startswith("error: model.attention: triton needs the triton package"), line


def test_auto_picks_padded_on_the_cpu() -> None:
    from recsys_pipe.models.hstu_attention import uses_triton

    assert INTERPRETED  # this module runs the interpreted kernels
    assert not uses_triton("auto", torch.device("cpu"))
    assert uses_triton("triton", torch.device("cpu")) and not uses_triton("padded", torch.device("cuda"))
