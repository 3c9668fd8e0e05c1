"""Task functions by name: `@task("h2d", needs=...)` registers a function under the name a plan's
`fn:` uses, with what it needs from the run.

A plan names each task's function in one of two ways:

* `fn: h2d` -- a registered name (the shipped tasks, and any the user registers with `@task`);
* `fn: my_pkg.tasks:my_task` -- the import path of any function `fn(ctx)`, e.g. the user's own,
  registered or not. This `pkg.module:attr` form is the one import-path syntax of the configs
  (builders use it too); any other spelling is a config error naming the colon form
  (`recsys_pipe.config.resolve.check_import_path`).

Why a registry instead of comparing import paths: what a task needs from the run is declared on
the task (`needs`), so the plan builder asks the plan's tasks what to build and what to check
(`recsys_pipe.train.plan`, `recsys_pipe.train.build`), and a task reached by name or by any import
path is the same entry (entries are found by function identity, `spec_of`).

Registering a task:

    from recsys_pipe.config import Need, task
    from recsys_pipe.engine import TaskContext
    from recsys_pipe.train import TrainState

    @task("my_prefetch", needs={Need.SPARSE_DIST, Need.PREFETCH_CONTEXT})
    def my_prefetch(ctx: TaskContext[TrainState]) -> None: ...

Task options: a task with settings of its own declares them as a pydantic model,
`@task("h2d", options=H2DOptions)`. A plan sets them under the task's `options:` (e.g.
`pipeline.tasks.h2d.options.inplace_copy=true`); the plan compiler validates them against the
model (unknown keys and wrong types are config errors at `pipeline.tasks.<task>.options.<key>`)
and hands the validated model to the engine task, where the function reads it with
`task_options(ctx, H2DOptions)` (the model's defaults when the task was built without a plan).

How names are found: a plan is compiled in a process that has not necessarily imported the module
defining a task, so on the first lookup of an unknown name the registry imports every module a
package named with `TASKS.add_modules(...)` (the training package names the shipped task modules
when it is imported: `recsys_pipe.train`; this package names none, it sits below them) and
every module advertised under the `recsys_pipe.tasks` entry-point group (how an installed
package makes its own registered tasks known by name:
`[project.entry-points."recsys_pipe.tasks"] my_tasks = "my_pkg.tasks"` in its pyproject.toml).
A module imported by other means (e.g. by the user's model builder) registers its tasks too.
"""

from __future__ import annotations

import enum
import importlib
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, TypeVar

from pydantic import BaseModel

from recsys_pipe.config.errors import suggest
from recsys_pipe.config.resolve import FnResolveError

__all__ = [
    "ENTRY_POINT_GROUP",
    "TASKS",
    "Need",
    "TaskRegistry",
    "TaskSpec",
    "UnknownTaskError",
    "is_task_name",
    "task",
    "task_options",
]

#: Entry-point group through which an installed package names its own task modules.
ENTRY_POINT_GROUP = "recsys_pipe.tasks"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

F = TypeVar("F", bound=Callable[..., Any])
OptionsT = TypeVar("OptionsT", bound=BaseModel)


class Need(enum.Enum):
    """What a task needs from the run beyond its slots. The plan builder reads these:

    - `SPARSE_DIST`: torchrec's input distribution (`TrainState.sparse_dist`), which exists when
      the model has torchrec-sharded tables; without them the task has nothing to do (idle).
    - `PREFETCH_CONTEXT`: torchrec's prefetch context; the plan must set
      `pipeline.torchrec_context: prefetch` (a config error otherwise).
    - `BALANCER`: the batch balancer (`TrainState.balancer`), built when a task of the plan needs it.
    - `GRAD_BUFFERS`: megatron-core's gradient buffers (`TrainState.grad_buffers`,
      `trainer.dense_ddp=megatron`); with torch DDP the task has nothing to do (idle).
    """

    SPARSE_DIST = "sparse_dist"
    PREFETCH_CONTEXT = "prefetch_context"
    BALANCER = "balancer"
    GRAD_BUFFERS = "grad_buffers"


@dataclass(frozen=True)
class TaskSpec:
    """One registered task: its name in plans, its function and what it needs from the run."""

    name: str
    fn: Callable[..., Any]
    needs: frozenset[Need]
    #: the pydantic model of the task's `options:` (None: the task takes none)
    options: type[BaseModel] | None = None

    @property
    def path(self) -> str:
        """The function's import path as configs spell it (`pkg.module:func`): what `recsys-plan`
        prints, and what a plan may write instead of the name."""
        return f"{self.fn.__module__}:{self.fn.__qualname__}"


class UnknownTaskError(FnResolveError):
    """`fn` is a name that no task is registered under; the message suggests the closest."""


def is_task_name(fn: str) -> bool:
    """Whether a plan's `fn` is a registered-task name (an identifier) rather than an import path."""
    return bool(_NAME.fullmatch(fn))


class TaskRegistry:
    """Registered tasks by name and by function.

    Args:
        modules: modules imported on the first lookup, whose import registers tasks (more are
            named with `add_modules`).
        entry_point_group: entry-point group naming further such modules (None: none).
    """

    def __init__(self, modules: Iterable[str] = (), entry_point_group: str | None = None):
        self._modules = tuple(modules)
        self._group = entry_point_group
        self._by_name: dict[str, TaskSpec] = {}
        self._by_fn: dict[Callable[..., Any], TaskSpec] = {}
        self._lock = threading.RLock()
        self._loaded = False

    def register(
        self,
        name: str,
        fn: Callable[..., Any],
        needs: Iterable[Need] = (),
        options: type[BaseModel] | None = None,
    ) -> TaskSpec:
        """Register `fn` as task `name`; ValueError if the name is taken by another function or
        not an identifier, TypeError if a need is not a `Need` or `options` not a pydantic model.
        A module executed again (a reload) registers its new function objects in place of the old
        ones: the same definition."""
        if not isinstance(name, str) or not is_task_name(name):
            raise ValueError(f"a task name is an identifier (letters, digits, _), got {name!r}")
        if not callable(fn):
            raise TypeError(f"task '{name}': {fn!r} is not a function fn(ctx)")
        needs = frozenset(needs)
        wrong = [n for n in needs if not isinstance(n, Need)]
        if wrong:
            raise TypeError(f"task '{name}': needs must be Need members, got {wrong!r}")
        if options is not None and not (isinstance(options, type) and issubclass(options, BaseModel)):
            raise TypeError(f"task '{name}': options must be a pydantic model class, got {options!r}")
        spec = TaskSpec(name, fn, needs, options)
        with self._lock:
            taken = self._by_name.get(name)
            if taken is not None and taken.fn is not fn:
                if not _same_definition(taken.fn, fn):
                    raise ValueError(f"task name '{name}' is already registered for {taken.path}; choose another name")
                del self._by_fn[taken.fn]
            other = self._by_fn.get(fn)
            if other is not None and other.name != name:
                raise ValueError(f"{spec.path} is already registered as task '{other.name}'")
            self._by_name[name] = spec
            self._by_fn[fn] = spec
        return spec

    def add_modules(self, *modules: str) -> None:
        """Name more modules whose import registers tasks, imported on the next lookup of a name
        not registered yet: a package that defines tasks calls it when it is imported, so the
        registry (below every such package) never names them."""
        with self._lock:
            new = tuple(m for m in modules if m not in self._modules)
            if new:
                self._modules += new
                self._loaded = False

    def lookup(self, name: str) -> TaskSpec:
        """The task registered as `name`; UnknownTaskError (with a did-you-mean) if none is."""
        spec = self._by_name.get(name)
        if spec is None:
            self._load()
            spec = self._by_name.get(name)
        if spec is None:
            known = self.names
            raise UnknownTaskError(
                f"unknown task '{name}'{suggest(name, known)}; registered tasks: {', '.join(known)}; "
                "or give the import path of a function, pkg.module:function"
            )
        return spec

    def spec_of(self, fn: Any) -> TaskSpec | None:
        """The entry of function `fn` (however the plan reached it), or None if it is not registered."""
        try:
            return self._by_fn.get(fn)
        except TypeError:  # unhashable: not a registered function
            return None

    @property
    def names(self) -> tuple[str, ...]:
        """Every registered name, sorted (the task modules imported first)."""
        self._load()
        return tuple(sorted(self._by_name))

    def _load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True  # once, even if an import fails: lookups then report unknown names
            modules = list(self._modules)
            if self._group is not None:
                modules += [ep.value for ep in entry_points(group=self._group)]
        for module in modules:
            try:
                importlib.import_module(module)
            except Exception as exc:
                raise FnResolveError(f"importing task module '{module}' failed: {type(exc).__name__}: {exc}") from exc

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.names

    def __repr__(self) -> str:
        return f"TaskRegistry({sorted(self._by_name)})"


def _same_definition(old: Callable[..., Any], new: Callable[..., Any]) -> bool:
    """Whether `new` is `old`'s definition executed again (its module reloaded or re-imported)."""
    return (old.__module__, old.__qualname__) == (new.__module__, new.__qualname__)


#: The registry `@task` adds to and plans' `fn:` names are looked up in.
TASKS = TaskRegistry(entry_point_group=ENTRY_POINT_GROUP)


def task(
    name: str,
    *,
    needs: Iterable[Need] = (),
    options: type[BaseModel] | None = None,
    registry: TaskRegistry | None = None,
) -> Callable[[F], F]:
    """Register the decorated function as task `name` (what plans write as `fn: <name>`).

    The function itself is returned unchanged, so it stays importable and callable as before.

    Args:
        name: the task's name in plans.
        needs: what it needs from the run (`Need`); the plan builder builds, checks or reports it.
        options: the pydantic model of the task's own settings (a plan's `options:` for the task),
            or None when it takes none.
        registry: the registry to add it to (default: `TASKS`).

    Returns:
        The decorator."""

    def register(fn: F) -> F:
        (registry or TASKS).register(name, fn, needs, options)
        return fn

    return register


def task_options(ctx: Any, model: type[OptionsT]) -> OptionsT:
    """The validated `options` of the running task.

    Args:
        ctx: the task's context (`ctx.task.options`).
        model: the options' pydantic class, as registered with `@task(..., options=model)`.

    Returns:
        The options the plan set, or `model()`'s defaults when the task was built without them
        (e.g. `Task.from_fn` in a test)."""
    options = ctx.task.options
    if options is None:
        return model()
    if not isinstance(options, model):
        raise TypeError(f"task '{ctx.task.name}': options are a {type(options).__name__}, expected {model.__name__}")
    return options
