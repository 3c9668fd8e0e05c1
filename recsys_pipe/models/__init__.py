"""Recommendation models, their configs, and torchrec sharding.

A model is a builder and its `ModelConfig` subclass, picked by `model.name` from `MODELS` or by
`model.builder=pkg.module:function`; the model protocol is written down in
`recsys_pipe.models.base`. Shipped: HSTU (`hstu`), torchrec's DLRM (`dlrm`, `dlrm_dcn`) and a
plain-torch DLRM (`dlrm_torch`); for next-item retrieval SASRec (`sasrec`) and HSTU
(`hstu_retrieval`), see `recsys_pipe.models.retrieval`. Their dropout sites are `Dropout`
modules drawing from the run's `DropoutRng` (`recsys_pipe.models.dropout`).

Tables are sharded by torchrec's sharders, or by a project sharder that offers more types on the
CPU (`recsys_pipe.models.sharders`), with the plans of `recsys_pipe.models.sharding`.

Names are imported on first use (PEP 562): choosing one model never imports the others, and
`import recsys_pipe.models` loads no torchrec.
"""

from __future__ import annotations

from recsys_pipe._lazy import lazy_exports

_EXPORTS = {
    "SHARDING_TYPES": "base",
    "DenseSubmodules": "base",
    "ModelConfig": "base",
    "ShardedModelConfig": "base",
    "MODELS": "registry",
    "Dropout": "dropout",
    "DropoutRng": "dropout",
    "MICROBATCH_DROPOUT": "dropout",
    "MicrobatchDropoutRng": "dropout",
    "current_microbatch_seed": "dropout",
    "microbatch_seed": "dropout",
    "seeded_dropout": "dropout",
    "HSTUStage": "hstu_cut",
    "hstu_stages": "hstu_cut",
    "HSTURetrievalStage": "retrieval_cut",
    "SASRecStage": "retrieval_cut",
    "hstu_retrieval_stages": "retrieval_cut",
    "sasrec_stages": "retrieval_cut",
    "HSTUConfig": "hstu_config",
    "HSTULayer": "hstu",
    "HSTUModel": "hstu",
    "HSTURanker": "hstu",
    "RelativeBias": "hstu",
    "build_hstu": "hstu",
    "embedding_tables": "hstu",
    "DLRMConfig": "dlrm",
    "DLRMDCNConfig": "dlrm",
    "TorchDLRM": "dlrm",
    "TorchDLRMConfig": "dlrm",
    "build_dlrm_torch": "dlrm",
    "DLRMRanker": "dlrm_torchrec",
    "build_dlrm": "dlrm_torchrec",
    "build_dlrm_dcn": "dlrm_torchrec",
    "RetrievalConfig": "retrieval_config",
    "RetrievalHead": "retrieval",
    "RetrievalModel": "retrieval",
    "SASRecConfig": "retrieval_config",
    "SASRecEncoder": "sasrec",
    "build_sasrec": "sasrec",
    "HSTURetrievalConfig": "retrieval_config",
    "HSTURetrievalEncoder": "hstu_retrieval",
    "build_hstu_retrieval": "hstu_retrieval",
    "SHARDERS": "sharders",
    "offered_on_cpu": "sharders",
    "project_sharders": "sharders",
    "sharder_for": "sharders",
    "make_optimizer": "sharding",
    "make_sharded_model": "sharding",
    "sharding_plan": "sharding",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
