"""HSTU's attention-bias lookup on CUDA (`recsys_pipe.models.hstu.bias_lookup`): the sorted,
segmented backward gives the CPU indexing's values and the exact gradient (to float32 sums'
error), and the same bits on every run under `torch.use_deterministic_algorithms(True)` (what
the bitwise plan tests on CUDA rely on). Its speed is `recsys-bench bias_lookup`'s."""

import torch
from _launcher_runs import require_packages

CPU_COUNTERPART = (
    "tests/unit/test_models_hstu.py::test_summed_backward_lookup_matches_indexing_and_passes_gradcheck "
    "checks the same lookup against indexing on CPU"
)


def test_bias_lookup_on_cuda_matches_cpu_indexing_and_is_deterministic():
    require_packages("torchrec", "fbgemm_gpu")
    from recsys_pipe.models.hstu import RelativeBias, bias_lookup

    gen = torch.Generator().manual_seed(0)
    bias = RelativeBias(32, 32)
    times = torch.randint(60, 90 * 86_400, (64, 32), generator=gen).cumsum(1)
    index = bias.bucketize(times)
    grad = torch.randn(index.shape, generator=gen)
    expected = bias.time.detach()[index]
    # the exact sums (float64): float32 sums of ~65,000 terms, in any order, are off by ~1e-5
    exact = torch.zeros(33, dtype=torch.float64).index_put_((index,), grad.double(), accumulate=True)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        grads = []
        for _ in range(2):
            table = bias.time.detach().clone().cuda().requires_grad_(True)
            out = bias_lookup(table, index.cuda())
            out.backward(grad.cuda())
            grads.append(table.grad.cpu())
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(out.cpu(), expected)
    torch.testing.assert_close(grads[0].double(), exact, rtol=1e-4, atol=1e-4)
    assert torch.equal(grads[0], grads[1])
