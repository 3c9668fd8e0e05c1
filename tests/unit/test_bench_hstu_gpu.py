"""`recsys-bench hstu_gpu`: its FLOP formula (docs/benchmarks.md#hstu-at-production-sizes) against
counted FLOPs and the mask's pairs, and its `--quick` run on the CPU (both attentions, the Triton
one in Triton's interpreter)."""

from __future__ import annotations

import json

import torch
from torch.utils.flop_counter import FlopCounterMode

from recsys_pipe.bench.hstu_gpu import SHAPES, Shape, allowed_pairs, main, step_flops, zipf_lengths
from recsys_pipe.models.hstu_attention import attention_mask


def test_allowed_pairs_count_the_mask() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 20, (32,), generator=gen)
    candidates = torch.minimum(torch.randint(0, 6, (32,), generator=gen), lengths)
    assert allowed_pairs(lengths, candidates) == int(attention_mask(lengths, candidates, 20).sum())


def test_step_flops_are_the_counted_matmul_flops() -> None:
    """Projections and head from torch's FLOP counter on the model's own layers; the attention
    term is 4 D per allowed pair (q.k and A.v, 2 d per head each); backward twice forward."""
    from recsys_pipe.data.batch import ACTION_KEY, ITEM_KEY, DataSpec
    from recsys_pipe.models.hstu import HSTURanker
    from recsys_pipe.models.hstu_config import HSTUConfig

    shape = Shape(layers=3, width=16, heads=2, max_len=12, batch=4, candidates=2, tasks=2)
    lengths, candidates = torch.tensor([12, 5, 3, 9]), torch.tensor([2, 2, 2, 2])
    tokens, cands = int(lengths.sum()), int(candidates.sum())
    ranker = HSTURanker(
        HSTUConfig(embedding_dim=16, num_heads=2, num_layers=3, max_seq_len=12),
        DataSpec(num_tasks=2, vocab_sizes={ITEM_KEY: 10, ACTION_KEY: 3}),
    )
    layer = ranker.layers[0]
    with FlopCounterMode(display=False) as counter:
        layer.output(layer.uvqk(torch.randn(tokens, 16)).chunk(4, dim=-1)[0])
        ranker.head(torch.randn(cands, 16))
    counted = shape.layers * (counter.get_total_flops() - _head_flops(ranker, cands)) + _head_flops(ranker, cands)
    attention = shape.layers * 4 * 16 * allowed_pairs(lengths, candidates)
    assert step_flops(shape, lengths, candidates) == 3 * (counted + attention)


def _head_flops(ranker, rows: int) -> int:
    with FlopCounterMode(display=False) as counter:
        ranker.head(torch.randn(rows, ranker.head[0].in_features))
    return counter.get_total_flops()


def test_zipf_lengths_stay_in_range_and_favour_short_sequences() -> None:
    shape = SHAPES["e2e"]
    lengths = zipf_lengths(shape, torch.Generator().manual_seed(0))
    assert lengths.shape == (shape.batch,)
    assert int(lengths.min()) >= shape.min_len and int(lengths.max()) <= shape.max_len
    assert float(lengths.float().median()) < shape.max_len / 4


def test_quick_runs_both_attentions_on_the_cpu(capsys) -> None:
    main(["--quick"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    quick = report["shapes"]["quick"]
    assert quick["card"] == "cpu" and quick["peak_bf16_tflops"] is None
    for part in ("attention", "step"):
        for variant in ("padded", "triton"):
            entry = quick[part][variant]
            assert entry["wall_ms"]["median"] > 0 and entry["gpu_ms"] is None, (part, variant, entry)
    assert quick["step"]["triton"]["samples_per_s"] > 0 and quick["step"]["triton"]["mfu"] is None
    assert quick["attention"]["triton_vs_padded"] is not None
