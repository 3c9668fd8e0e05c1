"""Why Hydra could not compose a config, as the project's one-line `path: message` problems.

Hydra reports a misspelled key as "Key 'max_step' is not in struct ... use +trainer.max_step=10":
advice that is wrong here (the `+` adds a key no code reads, and the schema then refuses it), and
a YAML syntax error as a hundred lines of frames with the file and line at the end. This module
turns the exceptions of a failed composition into `ConfigProblem`s:

- a key the config does not have (command line or a config file, any group): its full path and
  the closest valid keys (`recsys_pipe.cli.keys.closest_keys`: the schema, the plan's task names
  and task fields), never the `+` advice;
- a YAML syntax error: `file:line:column: <the parser's message>`;
- an unknown group option: the group, the option and the closest options;
- an override that does not parse: the override and the parser's message.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from recsys_pipe.config import ConfigError, ConfigProblem

__all__ = ["composition_error", "yaml_message"]


def composition_error(
    exc: BaseException, schema: Any = None, search_dirs: Sequence[Path] = (), groups: Sequence[str] = ()
) -> ConfigError:
    """The ConfigError for a Hydra composition failure `exc`.

    Args:
        exc: what `hydra.compose` (or `@hydra.main`) raised.
        schema: the validated config class (a pydantic model), whose keys are suggested.
        search_dirs: the config directories, to find the file a bad key is in.
        groups: the config groups (`pipeline`, `data`, ...), suggested for a bad top-level key.
    """
    import yaml
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    chain = _chain(exc)
    for error in chain:
        if isinstance(error, yaml.MarkedYAMLError):
            return ConfigError(ConfigProblem("", yaml_message(error)))
    for error in chain:
        if isinstance(error, (ConfigKeyError, ConfigAttributeError)) and getattr(error, "full_key", None):
            return ConfigError(_unknown_key(error, exc, schema, search_dirs, groups))
    for error in chain:
        if isinstance(error, MissingConfigException):
            return ConfigError(_missing_option(error))
        if isinstance(error, OverrideParseException):
            return ConfigError(ConfigProblem("", f"override {error.override!r}: {_first_line(error.message)}"))
    return ConfigError(ConfigProblem("", _first_line(str(exc)) or type(exc).__name__))


def yaml_message(error: Any) -> str:
    """`file:line:column: problem (context at line:column)` of a PyYAML MarkedYAMLError."""
    mark = error.problem_mark or error.context_mark
    where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else "<yaml>"
    message = error.problem or error.context or "invalid YAML"
    if error.context and error.problem:
        context = error.context
        if error.context_mark is not None and error.context_mark is not mark:
            context += f" at {error.context_mark.line + 1}:{error.context_mark.column + 1}"
        message += f" ({context})"
    return f"{where}: {message}"


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    error: BaseException | None = exc
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _unknown_key(error: Any, top: BaseException, schema: Any, search_dirs: Sequence[Path], groups: Sequence[str]):
    from recsys_pipe.cli.keys import closest_keys, format_suggestions

    path = str(error.full_key)
    parent = error.parent_node
    root = parent._get_root() if parent is not None else None
    values = OmegaConf.to_container(root, resolve=False) if isinstance(root, DictConfig) else {}
    siblings = list(parent.keys()) if isinstance(parent, DictConfig) else []
    where = note = ""
    source = re.match(r"In '([^']+)'", str(top))  # a config file, not the command line
    if source:
        location, written = _locate(source.group(1), error.key, search_dirs)
        where = f" in {location}"
        if isinstance(error.key, bool) and written:
            # YAML 1.1 reads `on:`, `no:`, `y:` ... as a boolean key: name the key as written.
            path = f"{path.rpartition('.')[0]}.{written}" if "." in path else written
            note = f" (YAML reads the key `{written}` as {str(error.key).lower()}; quote it to mean the word)"
    suggestions = closest_keys(path, values, schema, extra_siblings=siblings, groups=groups)
    return ConfigProblem(path, f"unknown key{where}{note}{format_suggestions(suggestions)}")


# The spellings YAML 1.1 (PyYAML, hence OmegaConf) reads as a boolean key.
_YAML_BOOLS = {True: ("true", "yes", "on", "y"), False: ("false", "no", "off", "n")}


def _locate(config: str, key: Any, search_dirs: Sequence[Path]) -> tuple[str, str]:
    """`file:line` of `key:` in the config file Hydra calls `config` (`pipeline/my_plan`), or
    the config's name when the file is not in `search_dirs` (a packaged or structured config);
    and the key as the file spells it ('' when not found)."""
    spellings = _YAML_BOOLS[key] if isinstance(key, bool) else (str(key),)
    alternatives = "|".join(re.escape(s) for s in spellings)
    pattern = re.compile(rf"^\s*({alternatives})\s*:", re.IGNORECASE if isinstance(key, bool) else 0)
    for directory in search_dirs:
        file = Path(directory) / f"{config}.yaml"
        if file.is_file():
            for number, line in enumerate(file.read_text(errors="replace").splitlines(), 1):
                found = pattern.match(line)
                if found:
                    return f"{file}:{number}", found.group(1)
            return str(file), ""
    return f"{config}.yaml", ""


def _missing_option(error: Any) -> ConfigProblem:
    """`optimizer=adamw` when conf/optimizer/ has no adamw.yaml."""
    import difflib

    from recsys_pipe.cli.keys import format_suggestions

    missing = str(error.missing_cfg_file or "")
    group, _, option = missing.rpartition("/")
    options = [str(o) for o in (error.options or [])]
    if not group or not options:  # a primary config or a defaults-list entry
        return ConfigProblem("", _first_line(str(error)))
    close = difflib.get_close_matches(option, options, n=3, cutoff=0.5)
    return ConfigProblem(
        group,
        f"no option '{option}'{format_suggestions([f'{group}={c}' for c in close])}; options: {', '.join(options)}",
    )
