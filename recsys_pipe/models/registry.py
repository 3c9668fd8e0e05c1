"""Models by name (`model.name=...`): each entry is the import path of the model's config class,
which names its builder; `model.builder=pkg.module:function` picks any other builder."""

from recsys_pipe.config import Registry
from recsys_pipe.models.base import ModelConfig

__all__ = ["MODELS"]

MODELS = Registry(
    "model",
    ModelConfig,
    {
        "hstu": "recsys_pipe.models.hstu_config:HSTUConfig",
        "dlrm": "recsys_pipe.models.dlrm:DLRMConfig",
        "dlrm_dcn": "recsys_pipe.models.dlrm:DLRMDCNConfig",
        "dlrm_torch": "recsys_pipe.models.dlrm:TorchDLRMConfig",
        "sasrec": "recsys_pipe.models.retrieval_config:SASRecConfig",
        "hstu_retrieval": "recsys_pipe.models.retrieval_config:HSTURetrievalConfig",
    },
)
