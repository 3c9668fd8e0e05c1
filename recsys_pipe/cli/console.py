"""What a run prints besides its own log: library warnings, once, on rank 0.

Why: torch and torchrec warn about deprecations on every process, so a 2-rank job printed each
warning twice per run, and once more per job of a sweep; fbgemm alone printed about 40 lines of
colour-coded deprecation notices when imported. By default rank 0 shows each distinct warning
once per job, except deprecation warnings (`DeprecationWarning`, `PendingDeprecationWarning`),
which are hidden as Python hides them outside `__main__`: they are addressed to the developers
of the code that calls the library, not to the person running it. The other ranks show none,
neither through `warnings` nor through torch's own loggers (`[rank1]:W... torch/...`).
Warnings that only describe torchrec's or torch's own internals (`INTERNAL_WARNINGS`: a
deprecated argument torchrec passes to DDP, the ShardedTensor type torchrec's tables use, a
behaviour change of `is_fx_tracing` that torchrec's tracer calls) are hidden on every rank: the
user can do nothing about them. `debug=true` shows every warning on every rank.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["INTERNAL_WARNINGS", "show_library_warnings"]

#: the loggers of the libraries whose warnings rank 0 alone shows
LIBRARY_LOGGERS = ("torch", "torchrec", "fbgemm_gpu")
#: (category, message regex) of `warnings` that describe the libraries' own internals only
INTERNAL_WARNINGS = (
    (FutureWarning, r"`broadcast_buffers` is deprecated"),  # torchrec's DMP passes it to DDP
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),  # torchrec's tables
    (FutureWarning, r"_check_is_size will be removed"),  # fbgemm's jagged operators, under torch.export
)
#: (logger, message prefix) of torch log records that describe its internals only
INTERNAL_LOG_RECORDS = (("torch.fx._symbolic_trace", "is_fx_tracing will return true"),)


class _InternalRecords(logging.Filter):
    """Drops the log records of `INTERNAL_LOG_RECORDS` (unless debug)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.debug = False

    def filter(self, record: logging.LogRecord) -> bool:
        return self.debug or not str(record.msg).startswith(self.prefix)


_RECORD_FILTERS: dict[str, _InternalRecords] = {}
_LEVELS: dict[str, int] = {}


def show_library_warnings(rank: int, debug: bool) -> None:
    """Set this process's warning filters for one job (call at the start of each job, and once
    when the process starts, before the libraries are imported)."""
    quiet = rank != 0 and not debug
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        _LEVELS.setdefault(name, logger.level)
        logger.setLevel(logging.ERROR if quiet else _LEVELS[name])
    if debug:
        warnings.simplefilter("default")
    elif rank == 0:
        warnings.simplefilter("once")
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        warnings.onceregistry.clear()  # once per job, not once per process of a sweep
    else:
        warnings.simplefilter("ignore")
    for name, prefix in INTERNAL_LOG_RECORDS:
        if name not in _RECORD_FILTERS:
            _RECORD_FILTERS[name] = _InternalRecords(prefix)
            logging.getLogger(name).addFilter(_RECORD_FILTERS[name])
        _RECORD_FILTERS[name].debug = debug
    if not debug:
        for category, message in INTERNAL_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
