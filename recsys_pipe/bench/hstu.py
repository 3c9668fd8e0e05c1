"""HSTU training throughput: recsys_pipe's trainer against generative-recommenders' research HSTU
(meta-recsys/generative-recommenders, `generative_recommenders/research/modeling/sequential/`, which
a user clones; `--reference PATH` is that clone, or `$RECSYS_HSTU_REFERENCE`), side by side on
the same machine, the same data and the same sizes.

Both train `--steps` batches at the sizes of the reference's ML-1M config
(`configs/ml-1m/hstu-sampled-softmax-n128-final.gin`): batch 128, sequences of at most 200 items
padded to 211 positions, width 50, 2 blocks, 1 head, dropout 0.2, sampled softmax with 128
negatives, temperature 0.05, L2-normalised vectors, Adam(W) with lr 1e-3, betas (0.9, 0.98) and
no weight decay on every weight, the item table included (ours on torchrec's dense kernel).
The reference runs its own modules (`HSTU`, `SampledSoftmaxLoss`, `LocalNegativesSampler`) in the
step of its `trainer/train.py`, on the same training samples (its data loading is not counted;
ours includes the data loader and its negatives). Both score 128 negatives per position (ours:
`model.negatives=per_position`, drawn by the data; the reference's: drawn by its sampler). One
process, `--threads` intra-op threads; repetitions alternate
between the variants. Prints samples/s of each, median (min-max), and the ratio ours / reference,
by the wall clock and by the process's CPU clock, then one JSON line.

`--levers` also trains variants that switch one speed lever back, to measure what each saves:
ours with dropout masks by `bernoulli_` (`mask`), with Adam's per-parameter loop (`fused_adam`),
with the blocks on every padded position instead of jagged tokens (`jagged`), with the item
table updated by fbgemm's fused row-wise Adagrad instead of Adam (`table_update`, a change of
recipe: a speed figure, not the reference's training); ours with one pool of 128 negatives shared
by the batch's positions (`shared_negatives`, `model.negatives=shared`: also a change of recipe);
and the reference with such a pool instead of its 128 per position (`reference, shared negatives`).

`--data FILE` is a "user item" or MovieLens ratings file; without it the benchmark writes an
ML-1M-shaped ratings file (6,040 users, 3,706 items, ML-1M's sequence lengths; 200 users with
`--quick`) to a temporary directory. `--quick`: a short run (small sizes, 2 steps, 1 repetition) that checks the wiring.

    recsys-bench hstu --reference generative-recommenders [--data ratings.dat] [--levers] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import torch

from recsys_pipe.bench.common import sequences_train_speed, summary

#: the environment variable naming a clone of generative-recommenders (tests and benchmark)
REFERENCE_ENV = "RECSYS_HSTU_REFERENCE"
#: the reference pads its attention to its data length + `gr_output_length` + 1 (10 + 1)
REFERENCE_EXTRA_POSITIONS = 11
_REFERENCE_FILE = "generative_recommenders/research/modeling/sequential/hstu.py"


@dataclass(frozen=True)
class Sizes:
    """The sizes both implementations train at (default: the reference's ML-1M config)."""

    data_len: int = 200
    dim: int = 50
    blocks: int = 2
    heads: int = 1
    negatives: int = 128
    batch: int = 128
    dropout: float = 0.2
    temperature: float = 0.05
    lr: float = 1e-3

    @property
    def attn_len(self) -> int:
        """Padded attention length N (the reference's)."""
        return self.data_len + REFERENCE_EXTRA_POSITIONS

    def overrides(self) -> list[str]:
        """Our Hydra overrides for these sizes (the reference's recipe)."""
        return [
            "model=hstu_retrieval",
            f"model.max_seq_len={self.attn_len}",
            f"model.embedding_dim={self.dim}",
            f"model.num_layers={self.blocks}",
            f"model.num_heads={self.heads}",
            f"model.dropout={self.dropout}",
            f"model.num_negatives={self.negatives}",
            "model.negatives=per_position",
            f"model.temperature={self.temperature}",
            f"data.max_seq_len={self.data_len}",
            f"data.batch_size={self.batch}",
            "model.compute_kernel=dense",  # Adam updates the item table, as in the reference
            f"optimizer.lr={self.lr}",
            "optimizer.betas=[0.9,0.98]",
        ]


QUICK = Sizes(data_len=20, dim=16, blocks=2, heads=2, negatives=16, batch=16)


# -- the reference implementation ------------------------------------------------------------


def _import_package(root: Path) -> None:
    """Import the clone's `generative_recommenders` package from its directory (registered in
    `sys.modules`, so that its own absolute imports resolve inside the clone), leaving the import
    path as it is; a second clone in one process is refused."""
    name = "generative_recommenders"
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(loaded.__path__[0]).resolve() != (root / name).resolve():
            raise SystemExit(f"error: --reference: {name} already imported from {loaded.__path__[0]}")
        return
    spec = importlib.util.spec_from_file_location(
        name, root / name / "__init__.py", submodule_search_locations=[str(root / name)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def load_reference(path: str | os.PathLike[str]) -> SimpleNamespace:
    """The reference's modules, imported from the clone at `path` (`_import_package`: the clone is
    a package tree, not installed). Needs nothing beyond this project's environment (its
    gin-configured `train.py` is not used)."""
    root = Path(path)
    if not (root / _REFERENCE_FILE).is_file():
        print(
            f"error: --reference: {root} is not a clone of generative-recommenders (no {_REFERENCE_FILE})",
            file=sys.stderr,
        )
        raise SystemExit(2)
    _import_package(root)
    from generative_recommenders.research.modeling.sequential import autoregressive_losses, hstu
    from generative_recommenders.research.modeling.sequential.embedding_modules import LocalEmbeddingModule
    from generative_recommenders.research.modeling.sequential.input_features_preprocessors import (
        LearnablePositionalEmbeddingInputFeaturesPreprocessor,
    )
    from generative_recommenders.research.modeling.sequential.losses.sampled_softmax import SampledSoftmaxLoss
    from generative_recommenders.research.modeling.sequential.output_postprocessors import L2NormEmbeddingPostprocessor
    from generative_recommenders.research.rails.similarities.dot_product_similarity_fn import DotProductSimilarity

    class SharedNegativesSampler(autoregressive_losses.LocalNegativesSampler):
        """The reference's sampler returning one pool of negatives (`pool`, reference ids) for
        every position, as ours shares its pool: the same negatives for both losses."""

        pool: torch.Tensor | None = None

        def forward(self, positive_ids: torch.Tensor, num_to_sample: int) -> tuple[torch.Tensor, torch.Tensor]:
            if self.pool is None:
                raise RuntimeError("set .pool before the loss")
            pool = self.pool[:num_to_sample]
            embeddings = self.normalize_embeddings(self._item_emb(pool))
            shape = (*positive_ids.shape, pool.numel())
            return pool.expand(shape), embeddings.expand(*shape, embeddings.shape[-1])

    return SimpleNamespace(
        HSTU=hstu.HSTU,
        LocalEmbeddingModule=LocalEmbeddingModule,
        Preprocessor=LearnablePositionalEmbeddingInputFeaturesPreprocessor,
        L2Norm=L2NormEmbeddingPostprocessor,
        DotProduct=DotProductSimilarity,
        SampledSoftmaxLoss=SampledSoftmaxLoss,
        LocalNegativesSampler=autoregressive_losses.LocalNegativesSampler,
        SharedNegativesSampler=SharedNegativesSampler,
    )


@dataclass
class ReferenceHSTU:
    """The reference's model, loss and negatives sampler, wired as its `train_fn` wires them."""

    model: torch.nn.Module
    loss: torch.nn.Module
    sampler: torch.nn.Module


def build_reference(
    ref: SimpleNamespace, sizes: Sizes, num_items: int, attn_len: int | None = None, shared_negatives: bool = False
) -> ReferenceHSTU:
    """The reference's HSTU for `num_items` items (its ids 1..num_items; 0 pads), with its own
    initialisation; `attn_len` (default `sizes.attn_len`) is its padded length, split as its
    `max_sequence_len` (`sizes.data_len`) plus `max_output_len`."""
    n = attn_len or sizes.attn_len
    with contextlib.redirect_stdout(None):  # its constructors print every parameter's initialisation
        embedding = ref.LocalEmbeddingModule(num_items=num_items, item_embedding_dim=sizes.dim)
        model = ref.HSTU(
            max_sequence_len=sizes.data_len,
            max_output_len=n - sizes.data_len,
            embedding_dim=sizes.dim,
            num_blocks=sizes.blocks,
            num_heads=sizes.heads,
            linear_dim=sizes.dim // sizes.heads,
            attention_dim=sizes.dim // sizes.heads,
            normalization="rel_bias",
            linear_config="uvqk",
            linear_activation="silu",
            linear_dropout_rate=sizes.dropout,
            attn_dropout_rate=0.0,
            embedding_module=embedding,
            similarity_module=ref.DotProduct(),
            input_features_preproc_module=ref.Preprocessor(n, sizes.dim, sizes.dropout),
            output_postproc_module=ref.L2Norm(embedding_dim=sizes.dim, eps=1e-6),
            verbose=False,
        )
    loss = ref.SampledSoftmaxLoss(num_to_sample=sizes.negatives, softmax_temperature=sizes.temperature, model=model)
    sampler_type = ref.SharedNegativesSampler if shared_negatives else ref.LocalNegativesSampler
    sampler = sampler_type(
        num_items=num_items,
        item_emb=embedding._item_emb,
        all_item_ids=list(range(1, num_items + 1)),
        l2_norm=True,
        l2_norm_eps=1e-6,
    )
    return ReferenceHSTU(model, loss, sampler)


def copy_weights(ours: torch.nn.Module, ref: ReferenceHSTU) -> None:
    """Load our `RetrievalModel`'s weights into the reference's modules (ids shifted by one)."""
    from recsys_pipe.models.retrieval import ITEM_TABLE

    encoder = ours.head.encoder
    model = ref.model
    d = ours.head.dim
    with torch.no_grad():
        table = ours.ec.embeddings[ITEM_TABLE].weight[:, :d]
        model._embedding_module._item_emb.weight[1:].copy_(table)
        model._input_features_preproc._pos_emb.weight.copy_(encoder.position.weight)
        for i, unit in enumerate(model._hstu._attention_layers):
            layer = encoder.layers[i]
            unit._uvqk.copy_(layer.uvqk.weight.T)
            unit._o.weight.copy_(layer.output.weight)
            unit._o.bias.copy_(layer.output.bias)
            if encoder.biases is not None:
                unit._rel_attn_bias._pos_w.copy_(encoder.biases[i].position)
                unit._rel_attn_bias._ts_w.copy_(encoder.biases[i].time)


def reference_gradients(ours: torch.nn.Module, ref: ReferenceHSTU) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Name -> (our gradient, the reference's gradient of the same weight), after a backward
    of each (the layout of `copy_weights`)."""
    from recsys_pipe.models.retrieval import ITEM_TABLE

    encoder, model, d = ours.head.encoder, ref.model, ours.head.dim
    pairs = {
        "item_table": (
            ours.ec.embeddings[ITEM_TABLE].weight.grad[:, :d],
            model._embedding_module._item_emb.weight.grad[1:],
        ),
        "position": (encoder.position.weight.grad, model._input_features_preproc._pos_emb.weight.grad),
    }
    for i, unit in enumerate(model._hstu._attention_layers):
        layer = encoder.layers[i]
        pairs[f"layers.{i}.uvqk"] = (layer.uvqk.weight.grad, unit._uvqk.grad.T)
        pairs[f"layers.{i}.output.weight"] = (layer.output.weight.grad, unit._o.weight.grad)
        pairs[f"layers.{i}.output.bias"] = (layer.output.bias.grad, unit._o.bias.grad)
        if encoder.biases is not None:
            pairs[f"biases.{i}.position"] = (encoder.biases[i].position.grad, unit._rel_attn_bias._pos_w.grad)
            pairs[f"biases.{i}.time"] = (encoder.biases[i].time.grad, unit._rel_attn_bias._ts_w.grad)
    return pairs


@dataclass
class ReferenceInputs:
    """One of our batches as the reference's training step takes it (`movielens_seq_features_from_row`
    after train.py scattered the target in): right-padded, ids + 1."""

    past_lengths: torch.Tensor  # [B]
    past_ids: torch.Tensor  # [B, N], the last target at past_lengths
    timestamps: torch.Tensor  # [B, N], the last target's time at past_lengths


def reference_inputs(batch: Any, attn_len: int) -> ReferenceInputs:
    """A `RetrievalBatch` of training samples (inputs s_1..s_m, targets s_2..s_m+1) -> the
    reference's `[s_1 .. s_m, s_m+1, 0 ..]` with its times."""
    from recsys_pipe.data.batch import INPUT_KEY, POS_KEY

    kjt = batch.sparse_features
    lengths = batch.lengths(INPUT_KEY).long()
    b = lengths.numel()
    inputs = torch.split(kjt[INPUT_KEY].values(), lengths.tolist())
    targets = torch.split(kjt[POS_KEY].values(), batch.lengths(POS_KEY).long().tolist())
    times = torch.split(batch.timestamps, lengths.tolist())
    ids = torch.zeros(b, attn_len, dtype=torch.int64)
    stamps = torch.zeros(b, attn_len, dtype=torch.int64)
    for i in range(b):
        m = int(lengths[i])
        ids[i, :m] = inputs[i] + 1
        ids[i, m] = targets[i][-1] + 1
        stamps[i, :m] = times[i]
        stamps[i, m] = batch.target_timestamps[i]
    return ReferenceInputs(lengths, ids, stamps)


def reference_forward(ref: ReferenceHSTU, inputs: ReferenceInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's training step up to the loss (train.py): (encoder output `[B, N, D]`, loss)."""
    model = ref.model
    embeddings = model.get_item_embeddings(inputs.past_ids)
    out = model(
        past_lengths=inputs.past_lengths,
        past_ids=inputs.past_ids,
        past_embeddings=embeddings,
        past_payloads={"timestamps": inputs.timestamps},
    )
    supervision = inputs.past_ids[:, 1:]
    loss, _ = ref.loss(
        lengths=inputs.past_lengths,
        output_embeddings=out[:, :-1, :],
        supervision_ids=supervision,
        supervision_embeddings=embeddings[:, 1:, :],
        supervision_weights=(supervision != 0).float(),
        negatives_sampler=ref.sampler,
    )
    return out, loss


# -- the benchmark -----------------------------------------------------------------------------


def write_ml1m_shaped(path: Path, users: int = 6040, seed: int = 0) -> Path:
    """A MovieLens ratings file shaped like ML-1M: 6,040 users (default), 3,706 items, per-user counts
    drawn log-normally (at least 20, median about 96, mean about 165, as ML-1M's), items drawn
    with a popularity skew, timestamps increasing by minutes to months. Its content is random:
    it measures speed, not accuracy."""
    rng = np.random.default_rng(seed)
    items = 3706
    counts = np.clip(rng.lognormal(np.log(96), 0.95, users).astype(int), 20, 2314)
    popularity = 1.0 / np.arange(1, items + 1) ** 0.8
    popularity /= popularity.sum()
    with path.open("w") as f:
        for user in range(users):
            chosen = rng.choice(items, size=min(counts[user], items), replace=False, p=popularity)
            stamps = 956703932 + np.cumsum(rng.exponential(3600.0, chosen.size) ** 1.3).astype(np.int64)
            f.writelines(f"{user + 1}::{item + 1}::4::{t}\n" for item, t in zip(chosen, stamps))
    return path


def _bernoulli_dropout(x: torch.Tensor, p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    from recsys_pipe.bench.sasrec import bernoulli_dropout

    return bernoulli_dropout(x, p, generator)


def _padded_forward(self: Any, x: torch.Tensor, timestamps: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`HSTURetrievalEncoder.forward` with the blocks on all B x N positions (padding included),
    as a padded implementation computes: the `jagged` lever switched off (speed only)."""
    full = torch.ones_like(valid)
    offsets, _ = self.geometry(full)
    pos = torch.arange(valid.shape[1], device=valid.device)
    mask = (valid[:, :, None] & valid[:, None, :] & (pos[:, None] >= pos[None, :])).float()
    tokens = self.run_layers(self.embed(x, full), offsets, mask, self.time_buckets(timestamps, full, offsets))
    out = self.finish(tokens, full)
    return out * valid[..., None]


#: the variants `--levers` trains: name -> levers switched off (ours), or the reference's sampler
LEVERS_OFF: dict[str, tuple[str, ...]] = {
    "all levers": (),
    "no mask": ("mask",),
    "no fused_adam": ("fused_adam",),
    "padded blocks": ("jagged",),
    "fused table update": ("table_update",),
    "shared negatives": ("shared_negatives",),
}


@contextlib.contextmanager
def levers_off(names: tuple[str, ...]) -> Iterator[list[str]]:
    """Within the block, the levers `names` take the stock path; yields extra overrides."""
    from recsys_pipe.bench.sasrec import loop_adam

    extra: list[str] = []
    with contextlib.ExitStack() as stack:
        if "mask" in names:
            stack.enter_context(mock.patch("recsys_pipe.models.dropout.dropout", _bernoulli_dropout))
        if "fused_adam" in names:
            stack.enter_context(mock.patch("recsys_pipe.train.optim.build_adam", loop_adam))
        if "jagged" in names:
            stack.enter_context(
                mock.patch("recsys_pipe.models.hstu_retrieval.HSTURetrievalEncoder.forward", _padded_forward)
            )
        if "table_update" in names:
            extra += ["model.compute_kernel=fused", "optimizer.sparse.name=rowwise_adagrad", "optimizer.sparse.lr=0.05"]
        if "shared_negatives" in names:
            extra += ["model.negatives=shared"]
        yield extra


def ours(data: str, sizes: Sizes, steps: int, info: Any, extra: list[str]) -> tuple[float, float]:
    """Samples/s of recsys_pipe's trainer at `sizes` (serial plan, `steps` steps), by the wall
    clock and by the CPU clock."""
    return sequences_train_speed(data, steps, info, *sizes.overrides(), *extra)


def training_batches(data: str, sizes: Sizes, steps: int) -> tuple[list[ReferenceInputs], int]:
    """The reference's inputs for the first `steps` batches of our training samples, and the item count."""
    from recsys_pipe.data.batch import collate_retrieval
    from recsys_pipe.data.in_memory.sequences import SequencesDataConfig

    dataset = SequencesDataConfig(path=data, max_seq_len=sizes.data_len).dataset(0, 1)
    batches = []
    for b in range(steps):
        samples = [dataset[(b * sizes.batch + i) % len(dataset)] for i in range(sizes.batch)]
        batches.append(reference_inputs(collate_retrieval(samples), sizes.attn_len))
    return batches, dataset.num_items


def reference(
    ref: SimpleNamespace, sizes: Sizes, num_items: int, batches: list[ReferenceInputs], shared: bool
) -> tuple[float, float]:
    """Samples/s of the reference training `batches` in its train.py step (AdamW, its sampler
    or, with `shared`, one pool of negatives per batch), by the wall clock and by the CPU clock."""
    torch.manual_seed(0)
    model = build_reference(ref, sizes, num_items, shared_negatives=shared)
    model.model.train()
    optimizer = torch.optim.AdamW(model.model.parameters(), lr=sizes.lr, betas=(0.9, 0.98), weight_decay=0.0)
    start, cpu = time.perf_counter(), time.process_time()
    for inputs in batches:
        if shared:  # as ours: the pool drawn once per batch
            model.sampler.pool = torch.randint(1, num_items + 1, (sizes.negatives,))
        optimizer.zero_grad()
        _, loss = reference_forward(model, inputs)
        loss.backward()
        optimizer.step()
    samples = len(batches) * sizes.batch
    return samples / (time.perf_counter() - start), samples / (time.process_time() - cpu)


def main() -> None:
    """Alternate the variants `--reps` times; print samples/s and the ratios, then one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help='"user item" or MovieLens ratings file (default: an ML-1M-shaped one)')
    parser.add_argument(
        "--reference",
        default=os.environ.get(REFERENCE_ENV),
        help=f"clone of generative-recommenders (${REFERENCE_ENV})",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--levers", action="store_true", help="also train with each speed lever switched off")
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 steps, 1 repetition")
    args = parser.parse_args()
    if not args.reference:
        parser.error(f"--reference PATH (or ${REFERENCE_ENV}) is required")
    ref = load_reference(args.reference)
    sizes = QUICK if args.quick else Sizes()
    steps, reps = (2, 1) if args.quick else (args.steps, args.reps)
    torch.set_num_threads(args.threads)
    from recsys_pipe.runtime import init_distributed

    info = init_distributed("cpu", "gloo")
    with tempfile.TemporaryDirectory(prefix="recsys-bench-hstu-") as tmp:
        data = args.data or str(write_ml1m_shaped(Path(tmp) / "ratings.dat", users=200 if args.quick else 6040))
        batches, num_items = training_batches(data, sizes, steps)
        variants: dict[str, tuple[str, ...]] = dict(LEVERS_OFF) if args.levers else {"ours": ()}
        names = [*variants, "reference"] + (["reference, shared negatives"] if args.levers else [])
        results: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c in ("wall", "cpu")}
        for rep in range(reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:  # the order rotates
                if name.startswith("reference"):
                    speeds = reference(ref, sizes, num_items, batches, shared=name != "reference")
                else:
                    with levers_off(variants[name]) as extra:
                        speeds = ours(data, sizes, steps, info, extra)
                for clock, value in zip(("wall", "cpu"), speeds):
                    results[clock][name].append(value)
    report: dict[str, Any] = {"steps": steps, "reps": reps, "threads": args.threads}
    report["sizes"] = {k: getattr(sizes, k) for k in Sizes.__dataclass_fields__} | {"attn_len": sizes.attn_len}
    first = names[0]
    for clock, table in results.items():
        report[clock] = {}
        for name, values in table.items():
            entry = report[clock][name] = {"samples_per_s": summary(values, 1), "values": [round(v, 1) for v in values]}
            for base in ("reference", first):  # paired ratios, repetition by repetition
                if name not in ("reference", base):
                    entry[f"over_{base}"] = summary(a / b for a, b in zip(values, table[base]))
        print(f"-- {clock} clock")
        for name, r in report[clock].items():
            s = r["samples_per_s"]
            line = f"{name:28} {s['median']:8.1f} samples/s ({s['min']}-{s['max']})"
            for base in ("reference", first):
                if f"over_{base}" in r:
                    o = r[f"over_{base}"]
                    line += f"  / {base} {o['median']:.3f} ({o['min']}-{o['max']})"
            print(line)
    report["ratio"] = report["wall"][first]["over_reference"]["median"]
    report["ratio_cpu"] = report["cpu"][first]["over_reference"]["median"]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
