"""Console scripts: `recsys-plan` (show a compiled plan) and `recsys-train` (run it).

Hydra lives here and nowhere below; every app reads the packaged `recsys_pipe/conf` tree and
maps config errors to exit code 2 (see `_hydra.HydraApp`).
"""

from recsys_pipe.cli._hydra import CONF_DIR, EXIT_CONFIG_ERROR, HydraApp, hydra_app, register_schemas

__all__ = ["CONF_DIR", "EXIT_CONFIG_ERROR", "HydraApp", "hydra_app", "register_schemas"]
