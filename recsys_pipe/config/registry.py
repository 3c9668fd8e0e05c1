"""Registries of named components (models, data sources, optimizers): one way to pick and extend them.

A component is a *builder* function plus the config class of its keys:

    def build(cfg: MyModelConfig, spec: DataSpec) -> nn.Module: ...      # a model
    def build(cfg: MyDataConfig, rank: int, world_size: int) -> Dataset: # a data source
    def build(cfg: MyOptimizerConfig, params) -> torch.optim.Optimizer:  # an optimizer

The config class is the annotation of the builder's first parameter (a subclass of the kind's
base class, e.g. `ModelConfig`; the base class itself when it is not annotated); it validates
the section's keys, with config paths in every error, before anything is built.

A section picks its component in one of two ways:

* `name: dlrm` -- a name in the registry, which maps it to the import path of the component's
  config class; that class names its own builder (the default of its `builder` field).
* `builder: my_pkg.models:build` -- the import path of any builder, e.g. the user's own.

Import paths, not classes, so choosing one component never imports the others (a model that needs
torchrec is imported only when it is chosen). After validation the section's `builder` field
always holds the builder that will run.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, Field, StrictStr, model_validator

from recsys_pipe.config.errors import ConfigError, ConfigProblem, UserCodeError, suggest
from recsys_pipe.config.resolve import FnResolveError, import_fn
from recsys_pipe.config.schema import Section

__all__ = ["Component", "Registry", "builder_config_class", "builder_field"]

_BUILDER_HELP = "import path pkg.module:function of the builder (your own component, instead of name)"


def builder_field(path: str) -> Any:
    """The `builder` field of a registered component's config class, defaulting to its builder."""
    return Field(path, description=_BUILDER_HELP)


class Component(Section):
    """Base of a section whose component comes from a registry: `name` or `builder` picks it.

    A registered component's config class sets the default of `builder` to its own builder, so
    after validation `builder` always names the function that builds the component.
    """

    name: StrictStr | None = Field(None, description="a registered name (or leave it out and set builder)")
    builder: StrictStr | None = Field(None, description=_BUILDER_HELP)

    @model_validator(mode="before")
    @classmethod
    def _builder_null_means_default(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "builder" in data and data["builder"] is None:
            data = {k: v for k, v in data.items() if k != "builder"}
        return data

    def builder_fn(self) -> Callable[..., Any]:
        """The builder function (imported on first use)."""
        if not self.builder:
            raise RuntimeError(f"{type(self).__name__} names no builder")
        return import_fn(self.builder)

    def call_builder(self, section: str, *args: Any) -> Any:
        """`builder(self, *args)`; what it raises (other than a ConfigError, which reports bad
        input already) becomes a `UserCodeError` naming `<section>.builder` and the builder."""
        fn = self.builder_fn()
        try:
            return fn(self, *args)
        except ConfigError:
            raise
        except Exception as exc:
            raise UserCodeError(f"{section}.builder", str(self.builder), exc) from exc

    @property
    def label(self) -> str:
        """What to call this component in messages: its registered name or its builder."""
        return self.name or self.builder or type(self).__name__


class Registry:
    """Components of one kind: `name -> "package.module:ConfigClass"`.

    Args:
        kind: what the components are, for messages ("model", "data source", "optimizer").
        base: the config base class every component's config derives from.
        entries: registered names and the import paths of their config classes.
    """

    def __init__(self, kind: str, base: type[Component], entries: Mapping[str, str]):
        self.kind = kind
        self.base = base
        self._entries = dict(entries)

    @property
    def names(self) -> tuple[str, ...]:
        """The registered component names, in registration order."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def config_class(self, section: Any, path: str) -> type[BaseModel]:
        """The config class that validates `section` (the raw mapping at config path `path`):
        the one registered under `section["name"]`, or the one `section["builder"]` declares.
        ConfigError at `<path>.name` / `<path>.builder` if there is none."""
        section = section if isinstance(section, Mapping) else {}
        name, builder = section.get("name"), section.get("builder")
        known = ", ".join(self._entries)
        if builder is not None:
            if name is not None:
                raise ConfigError(
                    ConfigProblem(
                        f"{path}.builder",
                        f"set either {path}.name (a registered {self.kind}) or {path}.builder (your own builder), "
                        f"not both (got name '{name}')",
                    )
                )
            if not isinstance(builder, str) or not builder:
                raise ConfigError(ConfigProblem(f"{path}.builder", "expected an import path pkg.module:function"))
            try:
                fn = import_fn(builder)
            except FnResolveError as exc:
                raise ConfigError(ConfigProblem(f"{path}.builder", str(exc))) from None
            try:
                return builder_config_class(fn, self.base)
            except TypeError as exc:
                raise ConfigError(ConfigProblem(f"{path}.builder", str(exc))) from None
        if not isinstance(name, str) or not name:
            raise ConfigError(
                ConfigProblem(
                    f"{path}.name", f"missing or not a name (known {self.kind}s: {known}; or set {path}.builder)"
                )
            )
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
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise ConfigError(ConfigProblem(f"{path}.name", f"{target} is not a {self.base.__name__}"))
        return cls

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names})"


def builder_config_class(fn: Callable[..., Any], base: type[BaseModel]) -> type[BaseModel]:
    """The config class a builder declares: the annotation of its first parameter, which must be
    `base` or a subclass of it; `base` when the parameter is not annotated.

    Only that one annotation is evaluated (in the builder's module), so the builder's other
    annotations may name types that are imported for type checking only.
    """
    where = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise TypeError(f"{where} has no inspectable signature") from None
    if not params:
        raise TypeError(f"{where} takes no parameters; a builder takes its config first")
    annotation = params[0].annotation
    if annotation is inspect.Parameter.empty:
        return base
    if isinstance(annotation, str):  # `from __future__ import annotations`
        module = sys.modules.get(getattr(fn, "__module__", ""))
        namespace = getattr(fn, "__globals__", None) or (vars(module) if module else {})  # a class has none
        try:  # a name in the builder's own module
            annotation = eval(annotation, namespace)
        except Exception as exc:
            raise TypeError(
                f"the annotation '{params[0].annotation}' of {where}'s first parameter cannot be resolved: {exc}"
            ) from None
    if not (isinstance(annotation, type) and issubclass(annotation, base)):
        raise TypeError(
            f"the first parameter of {where} is annotated {annotation!r}, which is not {base.__name__} or a "
            "subclass of it (the config class that validates the section's keys)"
        )
    return annotation
