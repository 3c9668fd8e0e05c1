"""OmegaConf skeletons of the config tree, derived from the pydantic models: the single source of
every default is a pydantic `Field`; YAML files hold only what differs from it.

Why: Hydra closes the composed config (struct mode), so a command-line override of a key the
YAML did not spell out -- `pipeline.tasks.zero_grad.lookahead=1` when the YAML relies on the
default 0 -- would be refused without `+`. Merging the YAML into this skeleton gives every task
every field (with its default), so any field of any task is overridable by path, and a key that
is not a task field (`lookahed`) is refused by OmegaConf at composition time, with its path.

The same holds for every other section: `defaults_node(cls)` is a config class's defaults as a
plain node; the CLIs register one per registered component (`schema/model/hstu`, ...), which each
option file of conf/model, conf/data, conf/optimizer lists first in its defaults, and the
trainer's, `seed` and `debug` in the root skeleton.

Values are typed `Any` on purpose: type and range checks stay in the pydantic models, which
produce the project's `path: message` errors. The skeleton is generated from those models, so
there is one source of truth for field names and defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import MISSING, OmegaConf
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from recsys_pipe.config.schema import PlanConfig, TaskConfig, ThreadMapConfig

__all__ = ["defaults_node", "plan_skeleton", "root_skeleton"]


def _dataclass_of(model: type[BaseModel], overrides: dict[str, Any] | None = None) -> type:
    """A dataclass with the model's field names and defaults, every value typed Any."""
    overrides = overrides or {}
    fields = []
    for name, info in model.model_fields.items():
        if name in overrides:
            tp, spec = overrides[name]
        elif info.default_factory is not None:
            tp, spec = Any, dataclasses.field(default_factory=info.default_factory)
        elif info.default is PydanticUndefined:
            tp, spec = Any, dataclasses.field(default=MISSING)
        else:
            tp, spec = Any, dataclasses.field(default=info.default)
        fields.append((name, tp, spec))
    return dataclasses.make_dataclass(model.__name__, fields)


# A task's options stay open (struct mode off on that node only), so any key may be set from the
# command line or `load_run` without `+`: which keys a task has depends on its function, and the
# plan compiler checks them against the task's registered options model, with their paths.
_TaskSkeleton = _dataclass_of(
    TaskConfig,
    {"options": (Any, dataclasses.field(default_factory=lambda: OmegaConf.create({}, flags={"struct": False})))},
)
_ThreadMapSkeleton = _dataclass_of(ThreadMapConfig, {"map": (dict[str, Any], dataclasses.field(default_factory=dict))})
_PlanSkeleton = _dataclass_of(
    PlanConfig,
    {
        "thread_map": (_ThreadMapSkeleton, dataclasses.field(default_factory=_ThreadMapSkeleton)),
        "tasks": (dict[str, _TaskSkeleton], dataclasses.field(default_factory=dict)),
    },
)


def plan_skeleton() -> type:
    """The structured-config class of the `pipeline` node (tasks: Dict[str, TaskConfig])."""
    return _PlanSkeleton


def defaults_node(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s fields with their defaults, nested sections as nested nodes; a required field is
    `???` (OmegaConf's missing value), so the user must set it."""
    node: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if info.default_factory is not None:
            value = info.default_factory()  # type: ignore[call-arg]
        elif info.default is PydanticUndefined:
            value = MISSING
        else:
            value = info.default
        if isinstance(value, BaseModel):
            value = defaults_node(type(value))
        node[info.alias or name] = value
    return node


def root_skeleton(sections: dict[str, type[BaseModel]] | None = None, **values: Any) -> dict[str, Any]:
    """The node to register in Hydra's ConfigStore: `{pipeline: <skeleton>}`, plus the defaults of
    each fixed-class section in `sections` (e.g. `trainer`) and plain root `values` (`seed`)."""
    root: dict[str, Any] = {"pipeline": _PlanSkeleton}
    root.update({key: defaults_node(cls) for key, cls in (sections or {}).items()})
    root.update(values)
    return root
