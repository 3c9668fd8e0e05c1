"""Compile a validated plan (`PlanConfig`) into the engine's dependency graph and thread assignment.

Why a separate compile step: the pydantic models check each value in isolation; whether the
plan *as a whole* makes sense (names refer to real tasks and streams, no cycles, no future
reads, ...) is the engine validator's job. This module runs both and reports every problem with
its config path, so `recsys-plan` and `recsys-train` refuse a wrong plan before any process
group starts, with one precise message per mistake.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from recsys_pipe.config.errors import (
    ConfigError,
    ConfigProblem,
    problems_from_validation_error,
    suggest,
    task_path,
)
from recsys_pipe.config.resolve import FnResolveError, ResolveFn, import_fn, structure_only
from recsys_pipe.config.schema import PlanConfig, TaskConfig, ThreadMapConfig
from recsys_pipe.config.task_registry import TASKS, Need, TaskSpec, is_task_name
from recsys_pipe.engine import (
    DEFAULT_STREAM,
    DependencyGraph,
    Problem,
    Task,
    TaskGraph,
    TaskGraphValidationError,
    TaskGroup,
    compile_dependencies,
    cpu_edges,
    resolve_thread_map,
)

__all__ = ["CompiledPlan", "CpuEdge", "compile_plan", "plan_from_any", "thread_assignment"]


@dataclass(frozen=True)
class CpuEdge:
    """An ordering edge between two tasks of one iteration, as the executor sees it.

    kind: the declaration behind it ("slot", "depends_on", "same_progress_sync",
    "cross_iter(Δ=0)") or "stream_fifo" (the previous task on the same stream, which the
    threaded executor enforces across threads). `cross_thread`: whether it costs a CPU wait.
    """

    producer: str
    consumer: str
    kind: str
    cross_thread: bool


@dataclass(frozen=True)
class CompiledPlan:
    """A validated plan compiled for the engine, plus what `recsys-plan` shows about it.

    Compiled once per run and handed forward: the trainer builds its training and evaluation
    pipelines from the same object. It holds declarations only; the runtime objects (streams,
    worker threads) are created by the layer that runs the plan.
    """

    config: PlanConfig
    graph: DependencyGraph
    #: task name -> CPU thread id (what the threaded executor uses; "main" when sequential).
    thread_of: Mapping[str, str]
    #: task name -> its registry entry (`fn: <name>`, or an import path of a registered function);
    #: absent for a function that is not registered (or not imported: structure-only).
    specs: Mapping[str, TaskSpec] = dataclasses.field(default_factory=dict)

    @property
    def task_graph(self) -> TaskGraph:
        """The engine `TaskGraph` the plan declares (its groups, tasks and streams)."""
        return self.graph.task_graph

    @property
    def order(self) -> tuple[Task, ...]:
        """The tasks in topological order: the order every rank submits them in."""
        return self.graph.order

    @property
    def threaded(self) -> bool:
        """Whether the plan runs on the threaded executor (`executor: threaded`)."""
        return self.config.executor == "threaded"

    def fn_paths(self) -> dict[str, str]:
        """task name -> import path of its function, in topological order: a registered task's
        own `pkg.module.func` (also for `fn: <name>`), else `fn` as the plan writes it."""
        return {
            t.name: self.specs[t.name].path if t.name in self.specs else self.config.tasks[t.name].fn
            for t in self.order
        }

    def needing(self, need: Need) -> list[str]:
        """Names of the tasks whose registry entry declares `need`, in topological order."""
        return [t.name for t in self.order if t.name in self.specs and need in self.specs[t.name].needs]

    def cpu_edges(self) -> list[CpuEdge]:
        """In-iteration edges (declarations, then same-stream FIFO), each flagged cross-thread."""
        return [
            CpuEdge(e.producer, e.consumer, e.kind, self.thread_of[e.producer] != self.thread_of[e.consumer])
            for e in cpu_edges(self.graph)
        ]


def plan_from_any(plan: Any, prefix: str = "pipeline") -> PlanConfig:
    """Validate a plan given as PlanConfig, a mapping or an OmegaConf node."""
    if isinstance(plan, PlanConfig):
        return plan
    try:
        from omegaconf import DictConfig

        if isinstance(plan, DictConfig):
            from recsys_pipe.config.load import to_container

            plan = to_container(plan, prefix=prefix)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    try:
        return PlanConfig.model_validate(plan)
    except ValidationError as exc:
        raise ConfigError(
            problems_from_validation_error(exc, PlanConfig, prefix.split(".") if prefix else ())
        ) from None


def thread_assignment(plan: PlanConfig, tasks: Sequence[Task]) -> dict[str, str]:
    """task name -> thread id: the plan's thread map, overridden by each task's `thread:`.

    Args:
        plan: the validated plan (its `thread_map` and each task's `thread`).
        tasks: the engine tasks compiled from it.

    Returns:
        The thread id of every task, as the threaded executor will run them."""
    tm = plan.thread_map
    spec: Any
    if tm.strategy == "single":
        spec = {"default": tm.thread}
    elif tm.strategy == "dict":
        spec = {**tm.map, "default": tm.default}
    else:
        spec = tm.strategy
    base = resolve_thread_map(spec)
    return {t.name: plan.tasks[t.name].thread or str(base(t)) for t in tasks}


def compile_plan(plan: Any, *, resolve_fn: ResolveFn | None = None, prefix: str = "pipeline") -> CompiledPlan:
    """Validate and compile a plan.

    Each task's `fn` is a registered name (`fn: h2d`, looked up in `TASKS`, which imports the
    shipped task modules) or an import path of a function (`pkg.module:function`).

    Args:
        plan: the plan, as a `PlanConfig`, a mapping or an OmegaConf node.
        resolve_fn: how import paths become functions -- for a name, the registered function's
            own path; default imports them (`import_fn`); pass `structure_only` to compile without
            importing task code (names are still looked up, so a misspelt name is reported).
        prefix: the config path of the plan node, which every problem's path starts with.

    Returns:
        The `CompiledPlan`. Raises ConfigError listing every problem with its path."""
    cfg = plan_from_any(plan, prefix)
    resolve = resolve_fn or import_fn
    problems: list[ConfigProblem] = []

    stream_slots = _check_streams(cfg, prefix, problems)
    _check_references(cfg, prefix, stream_slots, problems)
    _check_thread_map(cfg.thread_map, cfg, prefix, problems)

    engine: list[ConfigProblem] = []
    tasks: list[Task] = []
    specs: dict[str, TaskSpec] = {}
    for name, tc in cfg.tasks.items():
        fn, spec = _resolve(resolve, name, tc, prefix, problems)
        if spec is not None:
            specs[name] = spec
        options = _task_options(name, tc, spec, prefix, problems)
        try:
            tasks.append(_build_task(name, fn, tc, options))
        except TaskGraphValidationError as exc:
            engine.extend(_engine_problems(exc.problems, prefix))

    graph = None
    if len(tasks) == len(cfg.tasks):
        task_graph = TaskGraph(groups=(TaskGroup(tuple(tasks)),), stream_slots=stream_slots)
        try:
            graph = compile_dependencies(task_graph)
        except TaskGraphValidationError as exc:
            engine.extend(_engine_problems(exc.problems, prefix))
    if problems or engine:
        # Our own checks carry suggestions; drop the engine's repeat of a path they reported.
        own = {p.path for p in problems}
        raise ConfigError(problems + [p for p in engine if p.path not in own])
    assert graph is not None

    if cfg.executor == "threaded":
        thread_of = thread_assignment(cfg, graph.order)
    else:
        thread_of = {t.name: "main" for t in graph.order}
    return CompiledPlan(cfg, graph, thread_of, specs)


# -- checks -------------------------------------------------------------------------------------


def _check_streams(cfg: PlanConfig, prefix: str, problems: list[ConfigProblem]) -> tuple[str, ...]:
    seen: dict[str, int] = {}
    for i, s in enumerate(cfg.streams):
        if s in seen:
            problems.append(ConfigProblem(f"{prefix}.streams[{i}]", f"stream '{s}' is listed twice"))
        seen.setdefault(s, i)
    # The default stream always exists; declaring it is optional.
    return tuple(dict.fromkeys([DEFAULT_STREAM, *cfg.streams]))


def _check_references(cfg: PlanConfig, prefix: str, streams: tuple[str, ...], problems: list[ConfigProblem]) -> None:
    names = list(cfg.tasks)
    known = ", ".join(names)
    for name, tc in cfg.tasks.items():
        if tc.stream not in streams:
            problems.append(
                ConfigProblem(
                    task_path(prefix, name, "stream"),
                    f"unknown stream '{tc.stream}'{suggest(tc.stream, streams)}; declared in {prefix}.streams: "
                    f"{', '.join(streams)}",
                )
            )
        for field in ("depends_on", "cross_iter_depends_on", "same_progress_sync"):
            for i, entry in enumerate(getattr(tc, field)):
                dep = entry if isinstance(entry, str) else entry[0]
                if dep not in cfg.tasks:
                    problems.append(
                        ConfigProblem(
                            task_path(prefix, name, field, i),
                            f"unknown task '{dep}'{suggest(dep, names)} (known: {known})",
                        )
                    )


def _check_thread_map(tm: ThreadMapConfig, cfg: PlanConfig, prefix: str, problems: list[ConfigProblem]) -> None:
    names = list(cfg.tasks)
    for task in tm.map:
        if task not in cfg.tasks:
            problems.append(
                ConfigProblem(
                    f"{prefix}.thread_map.map.{task}",
                    f"unknown task '{task}'{suggest(task, names)} (known: {', '.join(names)})",
                )
            )


def _resolve(
    resolve: ResolveFn, name: str, tc: TaskConfig, prefix: str, problems: list[ConfigProblem]
) -> tuple[Any, TaskSpec | None]:
    """The task's function and its registry entry (None if it is not a registered function)."""
    spec = None
    try:
        if is_task_name(tc.fn):
            spec = TASKS.lookup(tc.fn)
            # the function itself (it may not be importable by path: a nested definition), unless
            # the caller substitutes functions (structure_only, stubs), which get its path
            fn = spec.fn if resolve is import_fn else resolve(spec.path)
        else:
            fn = resolve(tc.fn)
            spec = TASKS.spec_of(fn)
        if not callable(fn):
            raise FnResolveError(f"'{tc.fn}' resolved to a {type(fn).__name__}, not a function")
        return fn, spec
    except FnResolveError as exc:
        problems.append(
            ConfigProblem(
                task_path(prefix, name, "fn"), f"cannot resolve '{tc.fn}': {exc}" if tc.fn not in str(exc) else str(exc)
            )
        )
    except Exception as exc:
        problems.append(
            ConfigProblem(task_path(prefix, name, "fn"), f"cannot resolve '{tc.fn}': {type(exc).__name__}: {exc}")
        )
    return structure_only(tc.fn), spec


def _task_options(name: str, tc: TaskConfig, spec: TaskSpec | None, prefix: str, problems: list[ConfigProblem]) -> Any:
    """The task's `options:`, validated by its registered options model (an instance of it, with
    the model's defaults for keys the plan leaves out); a function that is not registered gets
    the mapping as written, or None without options."""
    if spec is None:
        return dict(tc.options) if tc.options else None
    if spec.options is None:
        if tc.options:
            problems.append(
                ConfigProblem(
                    task_path(prefix, name, "options"),
                    f"task '{spec.name}' takes no options (got {', '.join(map(str, tc.options))})",
                )
            )
        return None
    try:
        return spec.options.model_validate(tc.options)
    except ValidationError as exc:
        path = [*prefix.split("."), "tasks", name, "options"] if prefix else ["tasks", name, "options"]
        problems.extend(problems_from_validation_error(exc, spec.options, path))
        return None


def _build_task(name: str, fn: Any, tc: TaskConfig, options: Any = None) -> Task:
    return Task.from_fn(
        name,
        fn,
        stream=tc.stream,
        lookahead=tc.lookahead,
        reads=tuple(tc.reads),
        writes=tuple(tc.writes),
        depends_on=tuple(tc.depends_on),
        cross_iter_depends_on=tuple(tc.cross_iter_depends_on),
        same_progress_sync=tuple(tc.same_progress_sync),
        nccl=tc.nccl,
        nvtx_tag=tc.nvtx_tag,
        options=options,
    )


def _engine_problems(problems: Sequence[Problem], prefix: str) -> list[ConfigProblem]:
    return [ConfigProblem(task_path(prefix, p.task, p.field, p.index), p.message) for p in problems]
