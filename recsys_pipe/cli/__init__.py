"""Console scripts: `recsys-plan` (show a compiled plan) and `recsys-train` (run it).

Hydra lives here and nowhere below; every app reads the packaged `recsys_pipe/conf` tree and
maps failures to exit codes (see `app`): 0 ok, 1 failure after start-up, 2 config or input
error, 75 preempted by SIGTERM after a checkpoint, 130 Ctrl-C. The Hydra glue, by concern:

- `app`: `HydraApp`, the runner with its exit codes, `--check` and `--keep-going`;
- `compose`: `compose_config`, the config a CLI would see, without running anything;
- `schemas`: the defaults registered in Hydra's ConfigStore;
- `sweep_dir`: the `${recsys_sweep_dir:...}` resolver (one directory per sweep, on every rank);
- `reporting`: the `error: <path>: <message>` lines, printed by one rank;
- `compose_errors`: Hydra's composition failures as those problems;
- `hydra_adapter`: every use of Hydra's internals, and only there.
"""

from recsys_pipe.cli.app import (
    CHECK_ONLY,
    EXIT_CONFIG_ERROR,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
    KEEP_GOING,
    HydraApp,
)
from recsys_pipe.cli.compose import compose_config
from recsys_pipe.cli.reporting import first_to_report, report_config_error
from recsys_pipe.cli.schemas import register_schemas

__all__ = [
    "CHECK_ONLY",
    "EXIT_CONFIG_ERROR",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "KEEP_GOING",
    "HydraApp",
    "compose_config",
    "first_to_report",
    "register_schemas",
    "report_config_error",
]
