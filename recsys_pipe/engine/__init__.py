"""The engine: a plan of tasks with lookaheads, streams and dependencies, run by a `PlanRunner`
batch-ahead over a ring of in-flight batches.

Imports only the standard library, torch and nvtx (a test enforces it), so it can be reused
without torchrec, Hydra or pydantic.
"""

from recsys_pipe.engine.context import TaskContext
from recsys_pipe.engine.deps import (
    Dependency,
    DependencyGraph,
    Edge,
    EventWait,
    compile_dependencies,
    cpu_edges,
)
from recsys_pipe.engine.errors import (
    DependencyCycleError,
    PlanRunnerBrokenError,
    Problem,
    TaskFailedError,
    TaskGraphValidationError,
)
from recsys_pipe.engine.executor import Executor, SequentialExecutor
from recsys_pipe.engine.observe import (
    IterationSpan,
    RecordFunctionRanges,
    SpanRecorder,
    TaskObserver,
    TaskScopes,
    TaskSpan,
)
from recsys_pipe.engine.plan_runner import PlanRunner, fires
from recsys_pipe.engine.shortcut import shortcut_refusal
from recsys_pipe.engine.slots import BatchRing, SlotStore
from recsys_pipe.engine.stream_order import ImpliedWaits, implied_waits
from recsys_pipe.engine.streams import DEFAULT_STREAM, CudaTimer, NoOpEvent, NoOpStream, StreamPool
from recsys_pipe.engine.task import BATCH_CPU, STEP_RESULT, DataSlot, DeclaredIO, FnTask, Task, declare_effects
from recsys_pipe.engine.task_graph import TaskGraph, TaskGroup
from recsys_pipe.engine.threaded import ThreadedExecutor, resolve_thread_map

__all__ = [
    "BATCH_CPU",
    "STEP_RESULT",
    "DEFAULT_STREAM",
    "BatchRing",
    "CudaTimer",
    "DataSlot",
    "DeclaredIO",
    "Dependency",
    "DependencyCycleError",
    "DependencyGraph",
    "Edge",
    "EventWait",
    "Executor",
    "FnTask",
    "ImpliedWaits",
    "IterationSpan",
    "NoOpEvent",
    "NoOpStream",
    "PlanRunner",
    "PlanRunnerBrokenError",
    "Problem",
    "RecordFunctionRanges",
    "SequentialExecutor",
    "SlotStore",
    "SpanRecorder",
    "StreamPool",
    "Task",
    "TaskContext",
    "TaskFailedError",
    "TaskGraph",
    "TaskGraphValidationError",
    "TaskGroup",
    "TaskObserver",
    "TaskScopes",
    "TaskSpan",
    "ThreadedExecutor",
    "compile_dependencies",
    "cpu_edges",
    "declare_effects",
    "fires",
    "implied_waits",
    "resolve_thread_map",
    "shortcut_refusal",
]
