"""`--help`'s key listing (every config key, its current value and its one-line description) and
the closest valid keys to a misspelled one.

The descriptions are the pydantic schema's `Field(description=...)`, so the help cannot drift
from what is validated. Sections chosen by name (`model.name`, `data.name`, `optimizer.name`)
or by builder are described with the config class of the chosen component, and the values
shown include the user's overrides, so `recsys-train data=movielens --help` lists the
MovieLens keys.
"""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from recsys_pipe.config import ConfigError

__all__ = [
    "closest_keys",
    "closest_listed",
    "describe_keys",
    "format_keys",
    "format_suggestions",
    "key_matches",
    "misspelt_entry",
]

_UNSET = object()


def describe_keys(model: type[BaseModel], values: Any = None) -> list[tuple[str, str, str]]:
    """(path, current value, description) of every key of `model`, depth first; a section is a
    row with an empty value followed by its keys; a map of sections (`pipeline.tasks`) is listed
    once, as `<name>` keys."""
    rows: list[tuple[str, str, str]] = []
    _walk(model, values if isinstance(values, Mapping) else {}, "", rows)
    return rows


def key_matches(key: str, pattern: str) -> bool:
    """Whether the dotted `key` is the listed key `pattern`, where a `<name>` part of the
    pattern (a map of sections: `data.columns.sparse.<name>.num_embeddings`) stands for any name."""
    parts, wanted = key.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(w in (p, "<name>") for p, w in zip(parts, wanted))


def misspelt_entry(key: str, pattern: str, values: Any) -> bool:
    """Whether `key` (which `pattern` lists with `<name>` for a map's entry) names a new entry one
    typo or so away from an entry the map has (`pipeline.tasks.h2dd` for `h2d`): a misspelling,
    not a new entry such as `data.columns.sparse.user`."""
    parts = key.split(".")
    for at, part in enumerate(pattern.split(".")):
        if part != "<name>":
            continue
        entries: Any = values
        for step in parts[:at]:
            entries = entries.get(step) if isinstance(entries, Mapping) else None
        names = list(entries) if isinstance(entries, Mapping) else []
        if parts[at] not in names and _closest(parts[at], names, 1, cutoff=0.75):
            return True
    return False


def closest_listed(key: str, listed: Sequence[str], n: int = 3) -> list[str]:
    """The listed keys (`describe_keys` paths, `<name>` parts filled with `key`'s names) closest
    to the unknown `key` below its parent; never `key` itself."""
    parent, _, leaf = key.rpartition(".")
    depth = key.count(".")
    named = set()
    for pattern in listed:
        if pattern.count(".") == depth and key_matches(parent, pattern.rpartition(".")[0]):
            named.add(pattern.rpartition(".")[2])
    named.discard(leaf)
    return [f"{parent}.{c}" for c in _closest(leaf, sorted(named), n, cutoff=0.6)]


def format_keys(rows: list[tuple[str, str, str]]) -> str:
    """One line per key: `path=value` padded to a column, then the whole description (never cut:
    a terminal wraps a long line at its own width, and `grep` finds a key with all it says)."""
    column = min(48, max((len(_left(p, v)) for p, v, _ in rows), default=0) + 2)
    lines = []
    for path, value, description in rows:
        left = _left(path, value)
        gap = column - len(left) if len(left) < column else 2
        lines.append(f"  {left}{' ' * gap}{description}".rstrip())
    return "\n".join(lines)


def _left(path: str, value: str) -> str:
    return f"{path}={value}" if value else f"{path}:"


def _walk(model: type[BaseModel], values: Mapping, prefix: str, rows: list) -> None:
    components = getattr(model, "COMPONENTS", {})
    for name, field in model.model_fields.items():
        key = field.alias or name
        path = prefix + key
        value = values.get(key, _UNSET)
        description = _description(model, name)
        chosen = _component(components.get(key), value, path)
        section = chosen or _section(field.annotation)
        if section is not None:
            rows.append((path, "", description))
            _walk(section, value if isinstance(value, Mapping) else {}, path + ".", rows)
            continue
        entries = _map_of_sections(field.annotation)
        if entries is not None:
            names = ", ".join(value) if isinstance(value, Mapping) else ""
            rows.append((path, "", f"{description}{f' (here: {names})' if names else ''}"))
            _walk(entries, {}, f"{path}.<name>.", rows)
            continue
        if value is _UNSET:
            value = field.default_factory() if field.default_factory is not None else field.default
            value = None if value is PydanticUndefined else value
        rows.append((path, _format_value(value), description))


def _description(model: type[BaseModel], name: str) -> str:
    """The field's description, or the one of the base class field it overrides (a component's
    `name: Literal["hstu"]` refines `ModelConfig.name` without restating what it is)."""
    for cls in model.__mro__:
        fields = getattr(cls, "model_fields", {})
        if name in fields and fields[name].description:
            return fields[name].description
    return ""


def _component(registry: Any, value: Any, path: str) -> type[BaseModel] | None:
    if registry is None or not isinstance(value, Mapping):
        return None
    try:
        return registry.config_class(value, path)
    except ConfigError:
        return None


def _unwrap(annotation: Any) -> list[Any]:
    """The types an annotation allows (Optional/Union/Annotated/SerializeAsAny unwrapped)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in _unwrap(arg)]
    inner = getattr(annotation, "__origin__", None)  # pydantic's SerializeAsAny[...]
    if inner is not None and origin is None:
        return _unwrap(inner)
    return [annotation]


def _section(annotation: Any) -> type[BaseModel] | None:
    for t in _unwrap(annotation):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _map_of_sections(annotation: Any) -> type[BaseModel] | None:
    for t in _unwrap(annotation):
        if typing.get_origin(t) is dict:
            args = typing.get_args(t)
            if len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel):
                return args[1]
    return None


def _format_value(value: Any) -> str:
    """The value as `path=<value>` on a command line sets it: the plain form where Hydra's override
    grammar reads it back as the same value, else quoted (never cut: what is printed can be set)."""
    if value is None:
        return "null"
    if isinstance(value, BaseModel):
        return ""
    if value == "???":  # a required key not given yet
        return value
    if isinstance(value, str):
        forms = [value, "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"]
    else:
        try:
            exact = json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
        forms = [exact.replace('"', ""), exact]
    return next((text for text in forms if _reads_back(text, value)), forms[-1])


def _reads_back(text: str, value: Any) -> bool:
    from recsys_pipe.cli.hydra_adapter import parse_override_value

    try:
        return parse_override_value(text) == value
    except Exception:  # the grammar's own errors: this form does not read back
        return False


def closest_keys(
    path: str,
    values: Mapping | None = None,
    model: type[BaseModel] | None = None,
    extra_siblings: Sequence[str] = (),
    groups: Sequence[str] = (),
    n: int = 3,
) -> list[str]:
    """The valid full paths closest to the unknown key `path` (`trainer.max_step` ->
    [`trainer.max_steps`]), best first; [] if nothing is close.

    Candidates are the keys beside it (`extra_siblings`, the keys of `values` at its parent and
    the schema's fields there, with the components `values` picks: so `model.embeding_dim` is
    matched against the chosen model's fields, `pipeline.tasks.h2d.lookahed` against the task
    fields and `pipeline.tasks.h2dd` against the plan's task names), the config groups at the top
    level; if none is close, every key of the schema whose last part is close.
    """
    parent, _, leaf = path.rpartition(".")
    rows = describe_keys(model, values) if model is not None else []
    known = [p for p, _, _ in rows] + _paths({k: v for k, v in (values or {}).items() if k != "hydra"}, "")
    generic = re.sub(r"^pipeline\.tasks\.[^.]+", "pipeline.tasks.<name>", parent)
    siblings = set(extra_siblings)
    for candidate in known:
        head, _, tail = candidate.rpartition(".")
        if head in (parent, generic):
            siblings.add(tail)
    if not parent:
        siblings.update(groups)
    siblings.discard(leaf)
    close = _closest(leaf, sorted(siblings), n, cutoff=0.6)
    if close:
        return [f"{parent}.{c}" if parent else c for c in close]
    task = path.split(".")[2] if path.startswith("pipeline.tasks.") and path.count(".") >= 3 else None
    elsewhere = {c.replace("<name>", task) if task else c for c in known if task or "<name>" not in c}
    by_leaf: dict[str, list[str]] = {}
    for candidate in sorted(elsewhere):
        by_leaf.setdefault(candidate.rpartition(".")[2], []).append(candidate)
    matches = _closest(leaf, list(by_leaf), n, cutoff=0.75)
    return [p for m in matches for p in by_leaf[m] if p != path][:n]  # never the key refused itself


def _closest(word: str, candidates: list[str], n: int, cutoff: float) -> list[str]:
    """Candidates one typo away from `word` first, then difflib's close matches.

    Why not difflib alone: its similarity ratio punishes short words (`an` for `fn` scores 0.5,
    below any useful cutoff), and a key's one-letter typo must always find the key."""
    near = [c for c in candidates if _one_typo(word, c)]
    return list(dict.fromkeys(near + difflib.get_close_matches(word, candidates, n=n, cutoff=cutoff)))[:n]


def _one_typo(a: str, b: str) -> bool:
    """Whether `b` is `a` with one letter dropped, added, replaced, or two neighbours swapped."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (
            len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]
        )
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    return any(long_[:i] + long_[i + 1 :] == short for i in range(len(long_)))


def format_suggestions(paths: Sequence[str]) -> str:
    """` (did you mean trainer.max_steps?)`, ` (did you mean a, b or c?)`, or ''."""
    if not paths:
        return ""
    if len(paths) == 1:
        return f" (did you mean {paths[0]}?)"
    return f" (did you mean {', '.join(paths[:-1])} or {paths[-1]}?)"


def _paths(values: Mapping, prefix: str) -> list[str]:
    out = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        out.append(path)
        if isinstance(value, Mapping):
            out += _paths(value, path + ".")
    return out
