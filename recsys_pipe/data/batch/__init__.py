"""The batch contract: the batch types, their feature keys and the `DataSpec` that models, the
pipeline-parallel stages and the task functions consume. The protocol every batch follows and
its shared base (`protocol`), the sequence batch of HSTU ranking (`sequence`), the retrieval
batch (`retrieval`), the tabular batches of the DLRM family (`tabular`) and what a source tells
the model (`spec`). Code outside `recsys_pipe.data` imports
them from here (`from recsys_pipe.data.batch import SequenceBatch, ITEM_KEY, DataSpec`), never
from the sources that make them.

Names are imported on first use (PEP 562): importing this package loads no torch.
"""

from __future__ import annotations

from recsys_pipe._lazy import lazy_exports

_EXPORTS = {
    "TensorBatch": "protocol",
    "jagged_select": "protocol",
    "kjt_concat": "protocol",
    "kjt_select": "protocol",
    "register_with_torchrec": "protocol",
    "DataSpec": "spec",
    "ACTION_KEY": "sequence",
    "ITEM_KEY": "sequence",
    "MASKED_ACTION": "sequence",
    "USER_KEY": "sequence",
    "Sample": "sequence",
    "SequenceBatch": "sequence",
    "collate": "sequence",
    "CAND_KEY": "retrieval",
    "CATALOG_KEY": "retrieval",
    "INPUT_KEY": "retrieval",
    "NEG_KEY": "retrieval",
    "POS_KEY": "retrieval",
    "RETRIEVAL_KEYS": "retrieval",
    "RetrievalBatch": "retrieval",
    "RetrievalSample": "retrieval",
    "collate_retrieval": "retrieval",
    "distinct_negatives": "retrieval",
    "RawItemCollate": "retrieval",
    "raw_item_collate": "retrieval",
    "with_raw_items": "retrieval",
    "CATEGORICAL_KEYS": "tabular",
    "CriteoBatch": "tabular",
    "CriteoSample": "tabular",
    "TabularBatch": "tabular",
    "collate_criteo": "tabular",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
