"""Console scripts: `recsys-plan` (show a compiled plan) and `recsys-train` (run it).

Hydra lives here and nowhere below; every app reads the packaged `recsys_pipe/conf` tree and
maps failures to exit codes (see `_hydra`): 0 ok, 1 failure after start-up, 2 config or input
error, 75 preempted by SIGTERM after a checkpoint, 130 Ctrl-C.
"""

from recsys_pipe.cli._hydra import (
    CHECK_ONLY,
    CONF_DIR,
    EXIT_CONFIG_ERROR,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
    KEEP_GOING,
    HydraApp,
    compose_config,
    hydra_app,
    register_schemas,
)

__all__ = [
    "CHECK_ONLY",
    "CONF_DIR",
    "EXIT_CONFIG_ERROR",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "KEEP_GOING",
    "HydraApp",
    "compose_config",
    "hydra_app",
    "register_schemas",
]
