"""`--help`'s key listing: every config key, its current value and its one-line description.

The descriptions are the pydantic schema's `Field(description=...)`, so the help cannot drift
from what is validated. Sections chosen by name (`model.name`, `data.name`, `optimizer.name`)
or by builder are described with the config class of the chosen component, and the values
shown include the user's overrides, so `recsys-train data=movielens --help` lists the
MovieLens keys.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from recsys_pipe.config import ConfigError

__all__ = ["describe_keys", "format_keys"]

_UNSET = object()


def describe_keys(model: type[BaseModel], values: Any = None) -> list[tuple[str, str, str]]:
    """(path, current value, description) of every key of `model`, depth first; a section is a
    row with an empty value followed by its keys; a map of sections (`pipeline.tasks`) is listed
    once, as `<name>` keys."""
    rows: list[tuple[str, str, str]] = []
    _walk(model, values if isinstance(values, Mapping) else {}, "", rows)
    return rows


def format_keys(rows: list[tuple[str, str, str]], width: int = 120) -> str:
    """One line per key: `path=value` padded to a column, then the description."""
    column = min(48, max((len(_left(p, v)) for p, v, _ in rows), default=0) + 2)
    lines = []
    for path, value, description in rows:
        left = _left(path, value)
        gap = column - len(left) if len(left) < column else 2
        lines.append(f"  {left}{' ' * gap}{description}".rstrip()[: width + 40])
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
    if value is None:
        return "null"
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, str):
        text = value
    elif isinstance(value, (bool, int, float)):
        text = json.dumps(value)
    else:
        try:
            text = json.dumps(value, default=str).replace('"', "")
        except (TypeError, ValueError):
            text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."
