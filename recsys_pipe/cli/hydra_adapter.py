"""Every use of Hydra's internals (`hydra._internal`, `hydra.core`), in one small module.

Why: Hydra's public API (`@hydra.main`, `compose`) covers running an app, but checking every
job of a sweep before any starts needs Hydra's own command-line parser and its sweeper's
expansion of `a=1,2`, and a run needs to know which directory Hydra gave it. Those live in
modules Hydra does not promise to keep; keeping them here means one file to read on a Hydra
upgrade (a test checks that no other module imports `hydra._internal` or `hydra.core`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = [
    "HYDRA_MODE_UNKNOWN",
    "VERSION_BASE",
    "HydraRuntime",
    "checked_job",
    "composed_job",
    "clear_global_hydra",
    "compose_with_hydra_node",
    "hydra_main",
    "hydra_runtime",
    "parse_hydra_args",
    "parse_override_value",
    "store_config",
    "sweep_jobs",
]

#: Hydra's `version_base` for every entry point: the 1.3 defaults (no implicit run-dir chdir).
VERSION_BASE = "1.3"


def store_config(name: str, node: Any, group: str | None = None) -> None:
    """Register `node` in Hydra's ConfigStore as `<group>/<name>` (a config a YAML file can list)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=name, node=node, group=group)


def clear_global_hydra() -> None:
    """Forget Hydra's process-wide state, so that the next compose or app starts afresh."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()


def _copy_repositories_shallowly() -> None:
    """Make Hydra's per-composition `CachingConfigRepository` copy the repository it wraps
    shallowly instead of deeply.

    Why: Hydra deep-copies the whole repository on every composition (its sources, and with the
    structured-config source every node of the ConfigStore), only so that `initialize_sources` (a
    primary config's `hydra.searchpath`) cannot change the original. That copy was ~36 ms, a
    quarter of each composition: every start of a command, every job a sweep checks, and the
    test suite's ~2,000 compositions. `ConfigRepository.initialize_sources` binds a new `sources`
    list instead of changing the old one, and a source hands out copies of what it loads, so a
    shallow copy leaves the original just as untouched (the searchpath tests compose with it)."""
    from hydra._internal.config_repository import CachingConfigRepository

    def __init__(self: Any, delegate: Any) -> None:
        self.delegate = copy.copy(delegate)
        self.cache = {}

    CachingConfigRepository.__init__ = __init__


def _parse_config_files_once() -> None:
    """Make Hydra's config sources (the config directory's files, and Hydra's own configs in its
    package) parse each YAML file once per process and content.

    Why: Hydra reads and parses every config file again in each composition, with PyYAML's
    pure-Python loader: about a fifth of a composition, paid at every command's start, for every
    job a sweep checks and in each of the test suite's compositions. The parsed YAML (plain lists
    and dicts, keyed by the file and its whole text, so an edited file is parsed again) is kept;
    each load still gets its own `DictConfig`, made from a deep copy of it, as `OmegaConf.load`
    makes one (an empty file, or one of comments only, is an empty mapping). Anything unusual (a
    missing or unreadable file, a YAML error, a file that is a lone scalar) goes through Hydra's
    own code, with its own messages."""
    import yaml
    from hydra.core.plugins import Plugins

    Plugins.instance()  # its discovery of the plugins re-executes the sources' modules: patch after it
    from hydra._internal.core_plugins.file_config_source import FileConfigSource
    from hydra._internal.core_plugins.importlib_resources_config_source import ImportlibResourcesConfigSource
    from hydra.plugins.config_source import ConfigResult, ConfigSource
    from omegaconf._utils import get_yaml_loader

    parsed: dict[tuple[str, str], tuple[dict, Any]] = {}

    def cached(source: Any, where: str, text: str) -> Any:
        """The ConfigResult of `text` (the file `where`), or None where Hydra should read it."""
        key = (where, text)
        if key not in parsed:
            try:
                obj = yaml.load(text, Loader=get_yaml_loader())
            except yaml.YAMLError:
                return None
            if obj is not None and not isinstance(obj, (dict, list)):
                return None
            parsed[key] = (ConfigSource._get_header_dict(text[:512]), obj)
        header, obj = parsed[key]
        config = OmegaConf.create() if obj is None else OmegaConf.create(copy.deepcopy(obj))  # as OmegaConf.load
        path = f"{source.scheme()}://{source.path}"
        return ConfigResult(config=config, path=path, provider=source.provider, header=dict(header))

    read_file = FileConfigSource.load_config
    read_resource = ImportlibResourcesConfigSource._read_config

    def load_config(self: Any, config_path: str) -> Any:
        full_path = os.path.realpath(os.path.join(self.path, self._normalize_file_name(config_path)))
        try:
            with open(full_path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeError):
            return read_file(self, config_path)
        return cached(self, full_path, text) or read_file(self, config_path)

    def _read_config(self: Any, res: Any) -> Any:
        try:
            text = res.read_bytes().decode("utf-8")
        except (OSError, UnicodeError):
            return read_resource(self, res)
        return cached(self, str(res), text) or read_resource(self, res)

    FileConfigSource.load_config = load_config
    ImportlibResourcesConfigSource._read_config = _read_config


#: whether `_patch_hydra` ran in this process
_patched = False


def _patch_hydra() -> None:
    """Hydra's composition made cheaper (`_copy_repositories_shallowly`,
    `_parse_config_files_once`), once per process, before its first composition."""
    global _patched
    if not _patched:
        _copy_repositories_shallowly()
        _parse_config_files_once()
        _patched = True


def compose_with_hydra_node(config_dir: Path, config_name: str, overrides: list[str]) -> DictConfig:
    """The config Hydra composes from `config_dir` for `config_name` and `overrides`, with its
    `hydra` node; Hydra's global state is cleared before and after."""
    from hydra import compose, initialize_config_dir

    _patch_hydra()
    clear_global_hydra()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=VERSION_BASE):
            return compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    finally:
        clear_global_hydra()


#: `hydra_main`'s `mode` when no config was composed before it (Hydra then reads it itself)
HYDRA_MODE_UNKNOWN: Any = object()


def hydra_main(
    task: Callable[[DictConfig], Any], config_dir: Path, config_name: str, mode: Any = HYDRA_MODE_UNKNOWN
) -> Callable[[], Any]:
    """`@hydra.main` around `task`, reading `config_dir`: call it to run with `sys.argv`.

    Args:
        task: the task function Hydra calls with each job's config.
        config_dir: the primary config directory.
        config_name: the primary config's name.
        mode: the `hydra.mode` of the run's config (None where the config leaves it unset), when
            the caller has composed it already. Hydra's runner composes the whole config once
            just to read that key and then composes it again to run (about a quarter of a
            second per start, on every rank); given the value, the first composition is skipped.
    """
    import hydra

    _patch_hydra()
    main = hydra.main(config_path=str(config_dir), config_name=config_name, version_base=VERSION_BASE)(task)
    if mode is HYDRA_MODE_UNKNOWN:
        return main
    from hydra._internal.hydra import Hydra

    def run_knowing_the_mode() -> Any:
        composing = Hydra.get_mode
        Hydra.get_mode = lambda self, config_name, overrides: mode  # what it would compose to read
        try:
            return main()
        finally:
            Hydra.get_mode = composing

    return run_knowing_the_mode


def parse_hydra_args(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed by Hydra's own command-line parser (`overrides`, `multirun`, `cfg`, ...);
    SystemExit for a bad flag, as Hydra would."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(argv)


def quoted_home(arg: str) -> str:
    """`key=~/x` as `key='~/x'`: Hydra's override grammar has no `~` in an unquoted value (it
    stops with "LexerNoViableAltException"), and a shell expands `~` only at the start of a
    word; quoted, the value reaches the path key's validator, which expands it (`home_expanded`)."""
    key, sep, value = arg.partition("=")
    if not sep or arg.startswith("-") or "~" not in value or value[:1] in ("'", '"', "[", "{"):
        return arg
    return key + "='" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def parse_override_value(text: str) -> Any:
    """The value of `key=<text>` as Hydra's override grammar reads it (`[a,b]` a list, `null` None)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(f"k={text}").value()


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The overrides of each job of a `-m` sweep, in Hydra's order (its BasicSweeper's own
    expansion: the cartesian product of the comma-separated values)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


@dataclass(frozen=True)
class HydraRuntime:
    """What Hydra says about the job running in this process (inside `@hydra.main`)."""

    #: whether the job is one of a `-m` sweep
    multirun: bool
    #: its number in the sweep (0 for a single run)
    job_num: int
    #: the command line's overrides of the config (`trainer.lr=0.1`)
    task_overrides: tuple[str, ...]
    #: the command line's overrides of Hydra's own settings (`hydra.run.dir=...`)
    hydra_overrides: tuple[str, ...]
    #: the directory Hydra made for the job (None where Hydra composed a config without running
    #: a job, as `compose_config` does)
    output_dir: Path | None


#: the job `--check` checks, as it would run (`checked_job`); None otherwise
_CHECKED: list[HydraRuntime] = []


def composed_job(cfg: DictConfig) -> HydraRuntime:
    """The job a config composed with its `hydra` node would run as (`--check`'s view of it)."""
    hc = cfg.hydra
    multirun = str(hc.mode) == "RunMode.MULTIRUN"
    # unresolved: an override's value may be an interpolation that only the validation reports
    overrides = OmegaConf.to_container(hc.overrides, resolve=False)
    run_dir = OmegaConf.select(hc, "run.dir", default=None, throw_on_missing=False, throw_on_resolution_failure=False)
    return HydraRuntime(
        multirun=multirun,
        job_num=0,
        task_overrides=tuple(overrides.get("task", ())),
        hydra_overrides=tuple(overrides.get("hydra", ())),
        output_dir=None if multirun or run_dir is None else Path(str(run_dir)),
    )


@contextlib.contextmanager
def checked_job(job: HydraRuntime) -> Iterator[None]:
    """Inside, `hydra_runtime()` is `job` (`composed_job`) although Hydra runs none: `--check`
    then checks the run directory the job would use (`hydra.run.dir=...`) as the run does."""
    _CHECKED.append(job)
    try:
        yield
    finally:
        _CHECKED.pop()


def hydra_runtime() -> HydraRuntime | None:
    """The running job as Hydra sees it (or the job `--check` checks: `checked_job`), or None
    outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if _CHECKED:  # `--check`: the job checked now, whatever job Hydra ran before in this process
        return _CHECKED[-1]
    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    output_dir = OmegaConf.select(hc, "runtime.output_dir", default=None, throw_on_missing=False)
    return HydraRuntime(
        multirun=multirun,
        job_num=int(hc.job.num) if multirun else 0,  # only a sweep's jobs are numbered
        task_overrides=tuple(hc.overrides.task),
        hydra_overrides=tuple(hc.overrides.hydra),
        output_dir=None if output_dir is None else Path(output_dir),
    )
