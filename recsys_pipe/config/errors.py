"""ConfigError: every problem of a config, each with the config path it is about.

Why one error type with a list: a user fixing a YAML plan wants every mistake at once, each
pointing at the exact key (`pipeline.tasks.forward.depends_on[0]`), not a traceback that stops
at the first. This module turns the three sources of problems -- pydantic validation errors,
OmegaConf errors and the engine's `Problem`s -- into the same `(path, message)` form.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

__all__ = [
    "ConfigProblem",
    "ConfigError",
    "UserCodeError",
    "format_path",
    "suggest",
    "problems_from_validation_error",
    "task_path",
]


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with the config: where (a dotted config path) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(Exception):
    """The config is invalid. `problems` lists every problem found, in config order."""

    def __init__(self, problems: ConfigProblem | Iterable[ConfigProblem]):
        if isinstance(problems, ConfigProblem):
            problems = [problems]
        unique: dict[tuple[str, str], ConfigProblem] = {}
        for p in problems:
            unique.setdefault((p.path, p.message), p)
        self.problems: list[ConfigProblem] = list(unique.values())
        super().__init__("\n".join(str(p) for p in self.problems))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its problems (a rank's error travels to the others in DCP's collectives)."""
        return (type(self), (self.problems,))

    @property
    def paths(self) -> list[str]:
        """The config path of each problem, in the same order as `problems`."""
        return [p.path for p in self.problems]


class UserCodeError(Exception):
    """Code the config names (a component's builder) raised: `key` is the config key that named
    it, `target` its import path, `error` what it raised (also the `__cause__`).

    Why its own type: a user's bug is neither bad config (exit 2, one line) nor a failure of
    ours (a traceback of our frames); the report names the key and shows the user's frames
    (`recsys_pipe.runtime.failures.user_frames`)."""

    def __init__(self, key: str, target: str, error: BaseException):
        self.key, self.target, self.error = key, target, error
        first = str(error).splitlines()[0] if str(error) else ""
        super().__init__(f"{key} ({target}) raised {type(error).__name__}" + (f": {first}" if first else ""))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.target, self.error))


def format_path(loc: Sequence[Any]) -> str:
    """('pipeline', 'tasks', 'h2d', 'reads', 0) -> 'pipeline.tasks.h2d.reads[0]'."""
    out = ""
    for part in loc:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def task_path(prefix: str, task: str | None, field: str | None = None, index: int | None = None) -> str:
    """Config path of a task field: `<prefix>.tasks.<task>.<field>[<index>]`."""
    if task is None:
        return prefix
    path = f"{prefix}.tasks.{task}"
    if field is not None and field != "name":
        path += f".{field}"
        if index is not None:
            path += f"[{index}]"
    return path


def suggest(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or '' if nothing is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


# -- pydantic -----------------------------------------------------------------------------------


def problems_from_validation_error(
    error: ValidationError, root: type[BaseModel], prefix: Sequence[Any] = ()
) -> list[ConfigProblem]:
    """One ConfigProblem per pydantic error, with a config path and a readable message.

    `root` is the model that was validated (to list valid keys for unknown-key errors);
    `prefix` is the config path of the validated value (e.g. ('pipeline',)).
    """
    problems = []
    for err in error.errors(include_url=False):
        loc = _clean_loc(err["loc"])
        path = format_path([*prefix, *loc])
        kind = err["type"]
        if kind == "extra_forbidden":
            key = str(loc[-1]) if loc else "?"
            valid = _valid_keys(root, loc[:-1])
            message = f"unknown key '{key}'" + (_TARGET_HINT.get(_target_kind(valid), "") if key == "_target_" else "")
            message += suggest(key, valid)
            if valid:
                message += f"; valid keys: {', '.join(valid)}"
        elif kind == "missing":
            message = "missing list item" if loc and isinstance(loc[-1], int) else "missing required key"
        else:
            message = _message(err)
        problems.append(ConfigProblem(path, message))
    return problems


#: Hydra's `_target_` is not how these configs name code: what to write instead, by section kind.
_TARGET_HINT = {
    "fn": " (Hydra's _target_ is not used: name the task's function with fn:, a registered task or "
    "pkg.module:function)",
    "builder": " (Hydra's _target_ is not used: pick the component with name:, or your own with "
    "builder: pkg.module:function)",
}


def _target_kind(valid: Sequence[str]) -> str:
    """Which key replaces `_target_` in a section with these keys ('' if neither)."""
    return "fn" if "fn" in valid else "builder" if "builder" in valid else ""


def _clean_loc(loc: Sequence[Any]) -> tuple[Any, ...]:
    """Drop pydantic's internal union/validator tags from a location."""
    out = []
    for part in loc:
        if isinstance(part, str) and (
            part.startswith("function-") or part in {"str", "tuple[str,int]", "int", "list", "is-instance"}
        ):
            continue
        out.append(part)
    return tuple(out)


def _message(err: dict[str, Any]) -> str:
    msg = str(err["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    if "input" in err and err["type"] not in {"missing"} and not isinstance(err["input"], (dict, BaseModel)):
        shown = repr(err["input"])
        if len(shown) > 60:
            shown = shown[:57] + "..."
        # a validator's own message that already names the string (`no such file: x.txt`) needs no `got 'x.txt'`
        named = err["type"] == "value_error" and isinstance(err["input"], str) and err["input"] in msg
        if shown not in msg and not named:
            msg += f", got {shown}"
    return msg


def _valid_keys(root: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """Field names of the model found by walking `loc` from `root` (empty if not a model)."""
    node: Any = root
    for part in loc:
        node = _child_type(node, part)
        if node is None:
            return []
    node = _unwrap(node)
    if isinstance(node, type) and issubclass(node, BaseModel):
        return list(node.model_fields)
    return []


def _unwrap(tp: Any) -> Any:
    """Strip Annotated/Optional wrappers down to the model or container type."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _child_type(tp: Any, part: Any) -> Any:
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        field = tp.model_fields.get(str(part))
        return field.annotation if field is not None else None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is dict and len(args) == 2:
        return args[1]
    if origin in (list, tuple, set) and args:
        return args[0]
    return None
