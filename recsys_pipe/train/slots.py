"""The names of the slots the training tasks read and write: the one place they are spelt in code.

A slot is a named value of one batch in flight (`recsys_pipe.engine.SlotStore`); the plans in
conf/pipeline/*.yaml wire the tasks together by these names (`reads:` / `writes:`), and the task
functions (`recsys_pipe.train.tasks`), the state's bootstrap and the plan builder use the
constants below. `BATCH_CPU` and `STEP_RESULT` are the engine's own (what the data loader fills,
what `progress()` returns).

    batch_cpu -> h2d -> batch_gpu, torchrec_ctx
                 (balanced plans: h2d -> unbalanced_batch -> start_shuffle -> shuffle_plan
                                  -> finish_shuffle -> batch_gpu)
    batch_gpu, torchrec_ctx -> start_input_dist -> input_dist_splits
    input_dist_splits -> wait_input_dist -> input_dist_tensors
    input_dist_tensors -> prefetch_embeddings -> prefetched_input     (prefetch plans)
    batch_gpu -> global_tokens_allreduce -> global_tokens               (global-token loss)
    batch_gpu, torchrec_ctx, input_dist_tensors -> forward -> loss, model_out
    loss -> backward;  loss, model_out, batch_gpu -> optimizer_step -> step_result
"""

from __future__ import annotations

from recsys_pipe.engine import BATCH_CPU, STEP_RESULT

__all__ = [
    "BATCH_CPU",
    "BATCH_GPU",
    "GLOBAL_TOKENS",
    "INPUT_DIST_SPLITS",
    "INPUT_DIST_TENSORS",
    "LOSS",
    "MODEL_OUT",
    "PREFETCHED_INPUT",
    "SHUFFLE_PLAN",
    "STEP_RESULT",
    "TORCHREC_CTX",
    "UNBALANCED_BATCH",
]

#: The batch on the training device (written by h2d, or by finish_shuffle in balanced plans).
BATCH_GPU = "batch_gpu"
#: The batch's torchrec context, which the input-dist, prefetch and forward tasks fill and empty.
TORCHREC_CTX = "torchrec_ctx"
#: What start_input_dist started (the splits all-to-all in flight).
INPUT_DIST_SPLITS = "input_dist_splits"
#: What wait_input_dist leaves (the tensors all-to-all in flight).
INPUT_DIST_TENSORS = "input_dist_tensors"
#: What prefetch_embeddings leaves once the embedding cache is warm.
PREFETCHED_INPUT = "prefetched_input"
#: The loss tokens of the step summed over the ranks (global-token loss normalisation).
GLOBAL_TOKENS = "global_tokens"
#: Balanced plans: h2d writes the loaded batch here, finish_shuffle writes BATCH_GPU.
UNBALANCED_BATCH = "unbalanced_batch"
#: Balanced plans: the balancer's partition being solved (start_shuffle -> finish_shuffle).
SHUFFLE_PLAN = "shuffle_plan"
#: forward's loss (what backward differentiates).
LOSS = "loss"
#: forward's other outputs (logits, labels, ...), read by optimizer_step.
MODEL_OUT = "model_out"
