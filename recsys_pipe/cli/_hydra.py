"""Shared Hydra plumbing for the console scripts (`recsys-plan`, `recsys-train`).

Why a wrapper around `@hydra.main`: we keep Hydra's real entry point (so `--help`, `--cfg job`,
`-m` sweeps, `+`/`~` overrides and run dirs all behave as Hydra users expect) but fix its exit
codes: any config problem -- a bad override, an unknown group option, a typo'd key, an invalid
plan -- exits with code 2 and readable `error: <path>: <message>` lines, never a traceback
(unless `HYDRA_FULL_ERROR=1` or `debug=true`). Hydra itself exits 1 for everything. `--help`
ends with every key, its current value and its description (`recsys_pipe.cli.keys`).

Usage from a CLI module:

    def task(cfg: DictConfig) -> None: ...          # may raise ConfigError
    main = hydra_app(task, config_name="plan", prog="recsys-plan", schema="pkg.module:Config")
    # main() -> SystemExit(code); run(argv) -> code (in-process, for tests)
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from recsys_pipe.config import ConfigError
from recsys_pipe.runtime.failures import (  # the exit codes, re-exported for the CLIs
    EXIT_CONFIG_ERROR,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
)

__all__ = [
    "CONF_DIR",
    "EXIT_CONFIG_ERROR",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "HydraApp",
    "compose_config",
    "hydra_app",
    "register_schemas",
    "report_config_error",
]

#: The packaged config tree (the repo-root `conf` is a symlink to it).
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


#: Name under which the pipeline skeleton is registered; conf/config.yaml lists it first.
SCHEMA_NAME = "recsys_schema"
#: Group of the per-component defaults (see register_schemas).
DEFAULTS_GROUP = "hydra/recsys_defaults"


def register_schemas() -> None:
    """Register in Hydra's ConfigStore the defaults every YAML file overrides (one source per
    default: the pydantic `Field`s, see `recsys_pipe.config.structured`), and the
    `recsys_sweep_dir` resolver. Idempotent; must run before Hydra composes conf/config.yaml.

    - `recsys_schema`: the root: the `pipeline` skeleton, the trainer's defaults, `seed`, `debug`;
    - `hydra/recsys_defaults/<section>/<name>` for every registered model, data source and
      optimizer (and `.../builder` for a user's own builder): the option files of that group list
      theirs first (`- /hydra/recsys_defaults/model/hstu@_here_`). Under `hydra/` because --help
      lists every other group as a user's choice, and these are not.
    """
    from hydra.core.config_store import ConfigStore

    from recsys_pipe.config import ConfigError
    from recsys_pipe.config.structured import defaults_node, root_skeleton
    from recsys_pipe.train.config import RunConfig, TrainerConfig

    store = ConfigStore.instance()
    fields = RunConfig.model_fields
    store.store(
        name=SCHEMA_NAME,
        node=root_skeleton({"trainer": TrainerConfig}, seed=fields["seed"].default, debug=fields["debug"].default),
    )
    for section, registry in RunConfig.COMPONENTS.items():
        # model=custom, data=custom: the user must name their builder (??? is OmegaConf's "missing")
        store.store(
            group=f"{DEFAULTS_GROUP}/{section}", name="builder", node={**defaults_node(registry.base), "builder": "???"}
        )
        for name in registry.names:
            try:  # `builder` stays null: `name` picks it (a section sets one or the other)
                node = {**defaults_node(registry.config_class({"name": name}, section)), "builder": None}
            except ConfigError:  # cannot be imported here (e.g. no torchrec): validation says so, by path
                node = {"name": name}
            store.store(group=f"{DEFAULTS_GROUP}/{section}", name=name, node=node)
    if not OmegaConf.has_resolver("recsys_sweep_dir"):
        OmegaConf.register_new_resolver("recsys_sweep_dir", sweep_dir)


_SWEEP_DIRS: dict[str, str] = {}


def sweep_dir(base: str) -> str:
    """`${recsys_sweep_dir:<base>}`: a new directory `<base>/<time>` for one `-m` sweep.

    Unique (`-2`, `-3`, ... when two sweeps start in the same second) and, under torchrun, the
    same for every rank: local rank 0 of global rank 0 creates it and publishes the path in
    torchrun's store, the others read it there. Hydra resolves this more than once per sweep,
    so the answer is kept per process.
    """
    if base in _SWEEP_DIRS:
        return _SWEEP_DIRS[base]
    from recsys_pipe.runtime.rundir import unique_dir

    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "TORCHELASTIC_RUN_ID" in os.environ:
        import torch.distributed as dist

        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=300),
        )
        key = f"recsys_pipe/sweep_dir/{base}"
        if os.environ.get("RANK") == "0":
            store.set(key, unique_dir(base, stamp))
        path = store.get(key).decode()  # waits for rank 0
    else:
        path = unique_dir(base, stamp)
    _SWEEP_DIRS[base] = path
    return path


def _debug_requested(cfg: Any = None) -> bool:
    if os.environ.get("HYDRA_FULL_ERROR", "") == "1":
        return True
    try:
        return bool(cfg is not None and cfg.get("debug", False) is True)
    except Exception:
        return False


def report_config_error(error: ConfigError, prog: str, stream: Any = None, started: bool = False) -> None:
    """Print `error: <path>: <message>` per problem plus a one-line hint (`started`: found after
    the run started, e.g. a checkpoint that does not fit)."""
    stream = stream or sys.stderr
    for p in error.problems:
        print(f"error: {p}", file=stream)
    n = len(error.problems)
    outcome = "the run stopped" if started else "nothing was started"
    print(
        f"{prog}: {n} config error{'s' if n != 1 else ''}, {outcome}. "
        f"`{prog} --help` lists the groups and keys; debug=true shows a traceback.",
        file=stream,
    )


class HydraApp:
    """A Hydra app whose failures map to exit codes: 0 ok, 2 config error, 1 runtime error.

    Args:
        task: `task(cfg)`; raises ConfigError for bad input, SystemExit(code) to choose a code.
        config_name: the primary config in the packaged conf/ tree.
        prog: the command's name in messages.
        schema: "module:Class" of the validated config, for `--help`'s key listing.
    """

    def __init__(self, task: Callable[[DictConfig], Any], config_name: str, prog: str, schema: str | None = None):
        self.task = task
        self.config_name = config_name
        self.prog = prog
        self.schema = schema
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
            code = 0
        except KeyboardInterrupt:  # Ctrl-C before or after training (training handles its own)
            return EXIT_INTERRUPTED
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
        except Exception:  # HYDRA_FULL_ERROR=1 re-raises instead of exiting
            if not self._started:
                traceback.print_exc()
                return EXIT_CONFIG_ERROR
            raise
        finally:
            sys.argv = saved
            GlobalHydra.instance().clear()
        if code == 0 and ("--help" in argv or "-h" in argv):
            try:
                self._print_keys([a for a in argv if a not in ("--help", "-h")])
            except BrokenPipeError:  # `recsys-train --help | head`
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return code

    def _print_keys(self, overrides: list[str]) -> None:
        """`--help`'s last part: every key with its value (with `overrides`) and description."""
        from recsys_pipe.cli.keys import describe_keys, format_keys
        from recsys_pipe.config import import_fn, to_container

        try:
            cfg = compose_config(*(o for o in overrides if not o.startswith("-")), config_name=self.config_name)
            footer = OmegaConf.select(cfg, "hydra.help.footer", default="")
            with open_dict(cfg):
                del cfg["hydra"]
            values = to_container(cfg)
        except Exception as exc:  # the groups listing above is still useful
            print(f"(keys not listed: the config could not be composed: {exc})")
            return
        if self.schema:
            print("== Keys ==")
            print("Every key, its value with these overrides, and what it does (override any with path=value):\n")
            print(format_keys(describe_keys(import_fn(self.schema), values)))
        print(f"\n{footer}" if footer else "")
        sys.stdout.flush()

    def main(self) -> None:
        """Console-script entry point."""
        sys.exit(self.run())


def compose_config(*overrides: str, config_name: str = "config") -> DictConfig:
    """The config Hydra composes for `config_name` with these command-line overrides, with its
    `hydra` node (as `recsys-train`/`recsys-plan` would see it, without running anything)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def hydra_app(task: Callable[[DictConfig], Any], config_name: str, prog: str, schema: str | None = None) -> HydraApp:
    """Wrap `task(cfg)` as a Hydra app reading the packaged conf/ tree."""
    return HydraApp(task, config_name, prog, schema)
