"""What a run prints besides its own log: library warnings, once, on rank 0.

Why: torch and torchrec warn about deprecations on every process, so a 2-rank job printed each
warning twice per run, and once more per job of a sweep; fbgemm alone printed about 40 lines of
colour-coded deprecation notices when imported. By default rank 0 shows each distinct warning
once per job, except deprecation warnings (`DeprecationWarning`, `PendingDeprecationWarning`),
which are hidden as Python hides them outside `__main__`: they are addressed to the developers
of the code that calls the library, not to the person running it. The other ranks show none,
neither through `warnings` nor through torch's own loggers (`[rank1]:W... torch/...`).
`debug=true` shows every warning on every rank.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["show_library_warnings"]

#: the loggers of the libraries whose warnings rank 0 alone shows
LIBRARY_LOGGERS = ("torch", "torchrec", "fbgemm_gpu")
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
