"""Helpers shared by the test suite and the benchmark scripts, one module each: config helpers
(`config`: compose a config as the CLIs do, train a run in this process), launching workers on
several ranks and reading what they wrote (`launching`), fault injection into a training run
(`faults`), and the reference loops of the parity tests (`reference`: torchrec's own pipelines,
a stale-embedding loop).

Everything is importable from this package (`from recsys_pipe.testing import fork_ranks`); each
module imports only the standard library until a helper is called.

(The engine's own test backend -- recording streams and the happens-before checker -- is
`recsys_pipe.engine.testing`.)
"""

from __future__ import annotations

from recsys_pipe.testing.config import (
    built_trainer,
    compose,
    fit_resumed,
    fit_run,
    load_run,
    parity_overrides,
    parquet_criteo_overrides,
    raw_id_sequences,
    raw_id_windows,
    recsys_plan,
    train_here,
)
from recsys_pipe.testing.faults import FAULT_ENV, FAULT_OVERRIDE, PAUSE_ENV, inject_fault, zero_grad_with_fault
from recsys_pipe.testing.launching import (
    PRELOADED,
    check_torchrun,
    end_rank,
    fork_ranks,
    read_rank_results,
    run_torchrun,
    worker_env,
)
from recsys_pipe.testing.reference import (
    StaleEmbeddingLoop,
    run_stale_embedding_reference,
    run_torchrec_pipeline,
    torchrec_pipeline,
)

__all__ = [
    "FAULT_ENV",
    "FAULT_OVERRIDE",
    "PAUSE_ENV",
    "PRELOADED",
    "StaleEmbeddingLoop",
    "built_trainer",
    "check_torchrun",
    "compose",
    "end_rank",
    "fit_resumed",
    "fit_run",
    "fork_ranks",
    "inject_fault",
    "load_run",
    "parity_overrides",
    "parquet_criteo_overrides",
    "raw_id_sequences",
    "raw_id_windows",
    "read_rank_results",
    "recsys_plan",
    "run_stale_embedding_reference",
    "run_torchrec_pipeline",
    "run_torchrun",
    "torchrec_pipeline",
    "train_here",
    "worker_env",
    "zero_grad_with_fault",
]
