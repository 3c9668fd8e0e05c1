"""Process plumbing around a training run: the process group, the run directory and its
`status.json`, logging, dead-peer detection, SIGTERM agreement, undeclared-collective checks,
and the classification of failures into exit codes.

The training loop itself lives in `recsys_pipe.train`; it uses this package, never the other way
round (this package imports only `recsys_pipe.config`, `recsys_pipe.engine` and torch).
Names are imported on first use (PEP 562).
"""

from __future__ import annotations

from recsys_pipe._lazy import lazy_exports

_EXPORTS = {
    "DistInfo": "distributed",
    "init_distributed": "distributed",
    "resolve_device": "distributed",
    "teardown": "distributed",
    "EXIT_CONFIG_ERROR": "failures",
    "EXIT_FAILURE": "failures",
    "EXIT_INTERRUPTED": "failures",
    "EXIT_OK": "failures",
    "EXIT_PREEMPTED": "failures",
    "config_error_in": "failures",
    "is_communication_error": "failures",
    "one_line": "failures",
    "PeerFailure": "health",
    "PeerHealth": "health",
    "setup_logging": "logs",
    "CtrlC": "preemption",
    "StopRequest": "preemption",
    "check_output_dir": "rundir",
    "check_unused": "rundir",
    "shared_run_dir": "rundir",
    "unique_dir": "rundir",
    "RunSession": "session",
    "RunStatus": "status",
    "CollectiveGuard": "verify",
    "UndeclaredCollectiveError": "verify",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
