"""The batch contract: the batch types, their feature keys and the `DataSpec` that models, the
pipeline-parallel stages and the task functions consume. Code outside `recsys_pipe.data` imports
them from here (`from recsys_pipe.data.batch import SequenceBatch, ITEM_KEY, DataSpec`), never
from the sources that make them.

Names are imported on first use (PEP 562): importing this package loads no torch.
"""

from __future__ import annotations

from recsys_pipe._lazy import lazy_exports

_EXPORTS = {
    "ACTION_KEY": "protocol",
    "ITEM_KEY": "protocol",
    "MASKED_ACTION": "protocol",
    "USER_KEY": "protocol",
    "Sample": "protocol",
    "SequenceBatch": "protocol",
    "TensorBatch": "protocol",
    "collate": "protocol",
    "jagged_select": "protocol",
    "kjt_concat": "protocol",
    "kjt_select": "protocol",
    "register_with_torchrec": "protocol",
    "DataSpec": "spec",
    "TabularBatch": "tabular",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
