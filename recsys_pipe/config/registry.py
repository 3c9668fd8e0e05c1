"""Registries of named components (models, data sources): one way to pick and extend them.

A registry maps a name (`model.name=hstu`) to the import path of the component's config class,
a `Section` subclass next to the component's code that validates its keys and builds the
component. Import paths, not classes, so choosing one component never imports the others (a
model that needs torchrec is only imported when it is chosen).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from recsys_pipe.config.errors import ConfigError, ConfigProblem, suggest
from recsys_pipe.config.resolve import FnResolveError, import_fn

__all__ = ["Registry"]


class Registry:
    """Components of one kind: `name -> "package.module:ConfigClass"`."""

    def __init__(self, kind: str, entries: Mapping[str, str]):
        self.kind = kind
        self._entries = dict(entries)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def config_class(self, name: Any, path: str) -> type[BaseModel]:
        """The config class registered as `name`; ConfigError at `<path>.name` if there is none."""
        known = ", ".join(self._entries)
        if not isinstance(name, str) or not name:
            raise ConfigError(ConfigProblem(f"{path}.name", f"missing or not a name (known {self.kind}s: {known})"))
        target = self._entries.get(name)
        if target is None:
            raise ConfigError(
                ConfigProblem(
                    f"{path}.name", f"unknown {self.kind} '{name}'{suggest(name, self._entries)}; known: {known}"
                )
            )
        try:
            cls = import_fn(target)
        except FnResolveError as exc:
            raise ConfigError(ConfigProblem(f"{path}.name", f"{self.kind} '{name}' cannot be loaded: {exc}")) from None
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            raise ConfigError(ConfigProblem(f"{path}.name", f"{target} is not a config class"))
        return cls

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names})"
