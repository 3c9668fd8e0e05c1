"""The references of the parity tests: torchrec's own pipelines (`torchrec_pipeline`,
`run_torchrec_pipeline`) and, where torchrec's semi-synchronous pipeline cannot run (CPU), a
plain loop with one-step-stale embeddings (`StaleEmbeddingLoop`, `run_stale_embedding_reference`)."""

from __future__ import annotations

from typing import Any

__all__ = ["StaleEmbeddingLoop", "run_stale_embedding_reference", "run_torchrec_pipeline", "torchrec_pipeline"]


def torchrec_pipeline(model: Any, optimizer: Any, device: Any, pipeline: str, **options: Any) -> Any:
    """torchrec's own pipeline class `pipeline` (a name in
    `torchrec.distributed.train_pipeline.train_pipelines`) around `model`, constructed with
    `options`, whose `progress()` returns (loss, sample ids) of the batch it trained.

    `TrainPipelineBase` calls the model itself (no `custom_model_fwd`): it gets a wrapper module
    returning the same pair as the custom forward of the others.
    """
    import torch
    from torchrec.distributed.train_pipeline import train_pipelines

    def forward(batch: Any) -> tuple[Any, tuple[Any, Any]]:
        loss, _ = model(batch)
        return loss, (loss.detach(), batch.sample_ids)

    cls = getattr(train_pipelines, pipeline)
    if issubclass(cls, train_pipelines.TrainPipelineSparseDist):
        return cls(model, optimizer, device, custom_model_fwd=forward, **options)

    class _Forward(torch.nn.Module):  # TrainPipelineBase: model(batch) -> (losses, output)
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, batch: Any) -> tuple[Any, tuple[Any, Any]]:
            return forward(batch)

    return cls(_Forward(), optimizer, device, **options)


def run_torchrec_pipeline(
    model: Any,
    optimizer: Any,
    device: Any,
    batches: Any,
    pipeline: str = "TrainPipelineSparseDist",
    grad_accumulation: tuple[int, int] | None = None,
    **options: Any,
) -> tuple[list[float], list[list[int]]]:
    """Train every batch of `batches` with torchrec's own pipeline class (`torchrec_pipeline`),
    the reference the parity tests compare the plans with: per-step losses and trained sample ids.

    `grad_accumulation=(steps, warmup_steps)` wraps it in torchrec's `GradientAccumulationWrapper`.
    """
    pipe = torchrec_pipeline(model, optimizer, device, pipeline, **options)
    return _train_every_batch(pipe, model, optimizer, batches, grad_accumulation)


class StaleEmbeddingLoop:
    """One step per `progress(it)` of a plain training loop with semi-synchronous embeddings, the
    reference of the `semi_sync` plans where torchrec's TrainPipelineSemiSync cannot run (CPU):
    batch i's embedding lookup reads the tables as they were before batch i-1's update (one step
    stale) for i > `start_batch` (torchrec's synchronous warm-up before that; with the default 0,
    batches 0 and 1 both read the initial tables), while the dense part and the tables' own
    update are current.

    No pipelining machinery: the model's own forward (DistributedModelParallel), with each local
    table shard swapped to its previous-step copy for the forward and back to the current weights
    before backward, whose fused update then applies batch i's gradients to the current tables.
    Rows the lookup itself re-initialises (managed tables admitting ids, `ids: managed`) are
    re-initialised in the current tables too: exact where the previous batch did not update
    them (rows admitted into free slots), as in the plans the re-initialisation comes first.
    With `stash_gradients` the dense step after batch i >= start_batch applies batch i-1's
    gradients (the first such step none). It steps through `self._optimizer`, so torchrec's
    `GradientAccumulationWrapper` can wrap it like one of torchrec's pipelines.
    """

    def __init__(self, model: Any, optimizer: Any, stash_gradients: bool = False, start_batch: int = 0) -> None:
        self._model = model
        self._optimizer = optimizer
        self._stash = stash_gradients
        self._start = start_batch
        self._tables = _local_table_weights(model)
        self._previous: list[Any] | None = None
        self._kept: dict[str, Any] = {}
        self._index = 0

    def progress(self, it: Any) -> tuple[Any, Any]:
        """Train the next batch of `it` (StopIteration when it is exhausted, as torchrec's
        pipelines end); returns its loss and sample ids."""
        batch = next(it)  # StopIteration ends the run, as torchrec's pipelines
        batch = batch.to(self._tables[0].device, non_blocking=False)  # host batches, as the pipelines take them
        i, self._index = self._index, self._index + 1
        current = [w.detach().clone() for w in self._tables]
        stale = self._previous if self._previous is not None and i > self._start else current
        for weight, old in zip(self._tables, stale, strict=True):
            weight.data.copy_(old)  # .data: the lookup's saved weights keep their autograd version
        self._optimizer.zero_grad()
        loss, _ = self._model(batch)
        for weight, now, before in zip(self._tables, current, stale, strict=True):
            reset = (weight.data != before).any(dim=1)  # rows the lookup re-initialised
            now[reset] = weight.data[reset]
            weight.data.copy_(now)
        loss.backward()
        if self._stash and i >= self._start:
            for name, param in self._model.named_parameters():  # a copy: DDP may reuse the gradient's storage
                grad, param.grad = param.grad, self._kept.get(name)
                if grad is not None:
                    self._kept[name] = grad.clone()
        self._optimizer.step()
        self._previous = current
        return loss, batch.sample_ids


def run_stale_embedding_reference(
    model: Any,
    optimizer: Any,
    batches: Any,
    stash_gradients: bool = False,
    start_batch: int = 0,
    grad_accumulation: tuple[int, int] | None = None,
) -> tuple[list[float], list[list[int]]]:
    """Train every batch of `batches` with `StaleEmbeddingLoop` (wrapped in torchrec's
    `GradientAccumulationWrapper` with `grad_accumulation=(steps, warmup_steps)`): per-step
    losses and trained sample ids."""
    loop = StaleEmbeddingLoop(model, optimizer, stash_gradients, start_batch)
    return _train_every_batch(loop, model, optimizer, batches, grad_accumulation)


def _train_every_batch(
    loop: Any, model: Any, optimizer: Any, batches: Any, grad_accumulation: tuple[int, int] | None
) -> tuple[list[float], list[list[int]]]:
    """`loop.progress(it)` until it raises StopIteration (as torchrec's pipelines end once every
    batch is trained), wrapped in torchrec's `GradientAccumulationWrapper` with
    `grad_accumulation=(steps, warmup_steps)`: per-step losses and trained sample ids."""
    from torchrec.distributed.train_pipeline import GradientAccumulationConfig, GradientAccumulationWrapper

    if grad_accumulation is not None:
        steps, warmup = grad_accumulation
        config = GradientAccumulationConfig(num_steps=steps, num_warmup_steps=warmup)
        loop = GradientAccumulationWrapper(loop, optimizer, model, config)
    it, losses, ids = iter(batches), [], []
    while True:
        try:
            loss, sample_ids = loop.progress(it)
        except StopIteration:
            break
        losses.append(float(loss))
        ids.append(sample_ids.tolist())
    return losses, ids


def _local_table_weights(model: Any) -> list[Any]:
    """The local shards of the model's sharded tables, as views of the tables' own storage
    (writing into them changes what the lookup reads)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    weights = [
        shard.tensor
        for value in model.state_dict().values()
        if isinstance(value, ShardedTensor)
        for shard in value.local_shards()
        if shard.tensor.is_floating_point() and shard.tensor.dim() == 2  # not a managed table's remap
    ]
    if not weights:
        raise ValueError("the model has no sharded tables")
    return weights
