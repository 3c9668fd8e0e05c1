"""Shared Hydra plumbing for the console scripts (`recsys-plan`, `recsys-train`).

Why a wrapper around `@hydra.main`: we keep Hydra's real entry point (so `--help`, `--cfg job`,
`-m` sweeps, `+`/`~` overrides and run dirs all behave as Hydra users expect) but fix its exit
codes: any config problem -- a bad override, an unknown group option, a typo'd key, an invalid
plan -- exits with code 2 and readable `error: <path>: <message>` lines, never a traceback
(unless `HYDRA_FULL_ERROR=1` or `debug=true`). Hydra itself exits 1 for everything.

Usage from a CLI module:

    def task(cfg: DictConfig) -> None: ...          # may raise ConfigError
    main = hydra_app(task, config_name="plan", prog="recsys-plan")
    # main() -> SystemExit(code); run(argv) -> code (in-process, for tests)
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from recsys_pipe.config import ConfigError

__all__ = [
    "CONF_DIR",
    "EXIT_CONFIG_ERROR",
    "EXIT_PREEMPTED",
    "HydraApp",
    "hydra_app",
    "register_schemas",
    "report_config_error",
]

#: The packaged config tree (the repo-root `conf` is a symlink to it).
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
#: Exit code of every config error (argparse uses 2 for usage errors too).
EXIT_CONFIG_ERROR = 2
#: Exit code after a SIGTERM made every rank save a checkpoint and stop: resumable
#: (sysexits' EX_TEMPFAIL, "temporary failure, retry"; distinct from a kill by SIGTERM, 143).
EXIT_PREEMPTED = 75
#: Name under which the pipeline skeleton is registered; conf/config.yaml lists it first.
SCHEMA_NAME = "recsys_schema"


def register_schemas() -> None:
    """Register the structured skeleton of the `pipeline` node (see config.structured) in
    Hydra's ConfigStore. Idempotent; must run before Hydra composes conf/config.yaml."""
    from hydra.core.config_store import ConfigStore

    from recsys_pipe.config.structured import root_skeleton

    ConfigStore.instance().store(name=SCHEMA_NAME, node=root_skeleton())


def _debug_requested(cfg: Any = None) -> bool:
    if os.environ.get("HYDRA_FULL_ERROR", "") == "1":
        return True
    try:
        return bool(cfg is not None and cfg.get("debug", False) is True)
    except Exception:
        return False


def report_config_error(error: ConfigError, prog: str, stream: Any = None) -> None:
    """Print `error: <path>: <message>` per problem plus a one-line hint."""
    stream = stream or sys.stderr
    for p in error.problems:
        print(f"error: {p}", file=stream)
    n = len(error.problems)
    print(
        f"{prog}: {n} config error{'s' if n != 1 else ''}, nothing was started. "
        f"`{prog} --help` lists the groups and keys; debug=true shows a traceback.",
        file=stream,
    )


class HydraApp:
    """A Hydra app whose failures map to exit codes: 0 ok, 2 config error, 1 runtime error."""

    def __init__(self, task: Callable[[DictConfig], Any], config_name: str, prog: str):
        self.task = task
        self.config_name = config_name
        self.prog = prog
        self._started = False

    def _task(self, cfg: DictConfig) -> Any:
        self._started = True
        try:
            return self.task(cfg)
        except BrokenPipeError:  # `recsys-plan | head`: the reader left; not an error
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            raise SystemExit(0) from None
        except ConfigError as exc:
            if _debug_requested(cfg):
                traceback.print_exc()
            report_config_error(exc, self.prog)
            sys.stdout.flush()
            raise SystemExit(EXIT_CONFIG_ERROR) from None

    def run(self, argv: Sequence[str] | None = None) -> int:
        """Run with `argv` (default: sys.argv[1:]) and return the exit code."""
        import hydra
        from hydra.core.global_hydra import GlobalHydra

        register_schemas()
        self._started = False
        argv = list(sys.argv[1:] if argv is None else argv)
        entry = hydra.main(config_path=str(CONF_DIR), config_name=self.config_name, version_base="1.3")(self._task)
        # Hydra names the job after the task function's file unless the config says otherwise.
        saved = sys.argv
        sys.argv = [self.prog, *argv]
        try:
            entry()
            return 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
            if code == 1 and not self._started:
                # Hydra failed before our task ran: composing the config (override syntax, unknown
                # group option, key not in the config) failed. It printed why; that is a config error.
                print(
                    f"{self.prog}: the config could not be composed (see above), nothing was started. "
                    f"`{self.prog} --help` lists the groups and keys.",
                    file=sys.stderr,
                )
                return EXIT_CONFIG_ERROR
            return code
        except Exception:  # HYDRA_FULL_ERROR=1 re-raises instead of exiting
            if not self._started:
                traceback.print_exc()
                return EXIT_CONFIG_ERROR
            raise
        finally:
            sys.argv = saved
            GlobalHydra.instance().clear()

    def main(self) -> None:
        """Console-script entry point."""
        sys.exit(self.run())


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def hydra_app(task: Callable[[DictConfig], Any], config_name: str, prog: str) -> HydraApp:
    """Wrap `task(cfg)` as a Hydra app reading the packaged conf/ tree."""
    return HydraApp(task, config_name, prog)
