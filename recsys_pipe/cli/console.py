"""What a run prints besides its own log: library warnings, once.

Why: torch and torchrec warn about deprecations on every process, so a 2-rank job printed each
warning twice per run, and once more per job of a sweep. By default rank 0 shows each distinct
warning once per job and the other ranks none; `debug=true` shows them on every rank.
"""

from __future__ import annotations

import warnings

__all__ = ["show_library_warnings"]


def show_library_warnings(rank: int, debug: bool) -> None:
    """Set this process's warning filters for one job (call at the start of each job)."""
    if debug:
        warnings.simplefilter("default")
    elif rank == 0:
        warnings.simplefilter("once")
        warnings.onceregistry.clear()  # once per job, not once per process of a sweep
    else:
        warnings.simplefilter("ignore")
