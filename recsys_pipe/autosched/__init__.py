"""Plan tooling on top of the engine: cost profiling of running plan runners (per-task costs,
exposed time by shortcut replay, traces and timelines), cost models, the plan simulator,
lookahead assignment and plan tuning, plan YAML output, and pipeline-parallel schedules
(`recsys_pipe.autosched.pipeline_parallel`). Imports only the engine, the standard library,
numpy and matplotlib."""

from recsys_pipe.autosched.costs import CostModel, TaskCost
from recsys_pipe.autosched.exposed import ProfileResult, TaskProfiler
from recsys_pipe.autosched.plan_yaml import plan_yaml
from recsys_pipe.autosched.profiler import CostProfiler, EventTimer, TaskInstance, threads_of
from recsys_pipe.autosched.simulator import CriticalStep, SimResult, SimSpan, resolve_threads, simulate
from recsys_pipe.autosched.trace import chrome_trace, plot_timeline, write_chrome_trace
from recsys_pipe.autosched.tune import FROZEN_TASKS, TaskChange, TuneResult, auto_assign_lookaheads, tune

__all__ = [
    "FROZEN_TASKS",
    "CostModel",
    "CostProfiler",
    "CriticalStep",
    "EventTimer",
    "ProfileResult",
    "SimResult",
    "SimSpan",
    "TaskChange",
    "TaskCost",
    "TaskInstance",
    "TaskProfiler",
    "TuneResult",
    "auto_assign_lookaheads",
    "chrome_trace",
    "plan_yaml",
    "plot_timeline",
    "resolve_threads",
    "simulate",
    "threads_of",
    "tune",
    "write_chrome_trace",
]
