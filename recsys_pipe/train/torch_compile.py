"""`trainer.compile=true`: torch.compile of the model's dense modules, under every plan.

What is compiled is the model's to say: its module names its dense submodules
(`recsys_pipe.models.base.DenseSubmodules`: HSTU's ranker, the retrieval models' sequence
encoder, DLRM's dense, interaction and over arches). The torchrec embedding modules are left to
torchrec, as its `TrainPipelinePT2` leaves them (their input distribution and lookups are the
plan's tasks). Each submodule is compiled in place with `nn.Module.compile` after
`DistributedModelParallel` and the sparse-dist rewrite, so DDP, the plan's tasks, the state_dict
keys and checkpoints are those of the eager model (no `_orig_mod.` prefix).

Counting (`CompileStats`): compile seconds, graphs, graph breaks and recompiles of this model,
from torch._dynamo's compile callbacks and counters. The training loop logs them apart from step
time: a log window's samples/s leaves out the seconds spent compiling in it.

A combination that cannot compile (a model that names no dense modules, `fullgraph=true` over a
graph break, a backend that fails) exits 2 with one line naming the key (`CompileFailure`);
nothing falls back to eager silently.

Bitwise plans. On the CPU, inductor's scatter-adds (the backward of an indexing, an embedding)
are atomic adds across OpenMP threads, whose order changes from run to run;
`compile_options.deterministic` (default) turns on `torch.use_deterministic_algorithms` for the
run, and inductor then lowers them to torch's deterministic kernels: every plan trains the same
bits, as in eager mode.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field, StrictBool, StrictStr
from torch import nn

from recsys_pipe.config import ConfigError, ConfigProblem, Section
from recsys_pipe.models.base import DenseSubmodules

__all__ = ["CompileOptions", "CompileStats", "CompiledDense", "compile_dense", "compile_failures"]

log = logging.getLogger(__name__)


class CompileOptions(Section):
    """torch.compile's options for `trainer.compile=true` (`trainer.compile_options.*`); the
    defaults are torch.compile's own."""

    backend: StrictStr | None = Field(
        None,
        min_length=1,
        description="torch.compile backend (null: torch's default, inductor); aot_eager: graphs and autograd "
        "without code generation",
    )
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = Field(
        None, description="torch.compile mode (null: torch's default)"
    )
    dynamic: StrictBool | None = Field(
        None, description="dynamic shapes: null: static first, dynamic after a shape changes; true/false: always/never"
    )
    fullgraph: StrictBool = Field(
        False, description="one graph per dense module: a graph break is an error (exit 2), not a split"
    )
    deterministic: StrictBool = Field(
        True,
        description="torch.use_deterministic_algorithms for the run: inductor's CPU scatter-adds become deterministic, "
        "so every plan trains bitwise the same (false: atomic adds, bits may differ from run to run)",
    )

    def compile_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `torch.compile` / `nn.Module.compile`."""
        return {"backend": self.backend, "mode": self.mode, "dynamic": self.dynamic, "fullgraph": self.fullgraph}


@dataclass(frozen=True)
class CompileStats:
    """What torch.compile did for this model so far (cumulative since `compile_dense`)."""

    #: wall seconds inside torch.compile (forward frames and lazily compiled backward graphs)
    seconds: float = 0.0
    #: graphs compiled (dynamo's unique graphs)
    graphs: int = 0
    #: graph breaks (a frame split into graphs, or left to eager)
    graph_breaks: int = 0
    #: frames compiled again because a guard failed (a new shape, train/eval mode)
    recompiles: int = 0

    def since(self, earlier: CompileStats) -> CompileStats:
        """What was compiled after `earlier` (counts of the same model)."""
        return CompileStats(
            self.seconds - earlier.seconds,
            self.graphs - earlier.graphs,
            self.graph_breaks - earlier.graph_breaks,
            self.recompiles - earlier.recompiles,
        )

    def record(self) -> dict[str, Any]:
        """The `metrics.jsonl` keys of a log step."""
        return {
            "compile_s": round(self.seconds, 3),
            "compile_graphs": self.graphs,
            "compile_graph_breaks": self.graph_breaks,
            "compile_recompiles": self.recompiles,
        }

    def describe(self) -> str:
        """One log line's worth."""
        return (
            f"torch.compile: {self.seconds:.1f} s compiling (left out of samples/s), {self.graphs} graphs, "
            f"{self.graph_breaks} graph breaks, {self.recompiles} recompiles"
        )


def _counters() -> tuple[int, int]:
    """(unique graphs, graph breaks) in torch._dynamo's process-wide counters."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


class CompiledDense:
    """The dense modules of one model, compiled in place; counts what torch.compile does for them
    (`stats`) until `close`, which also restores the deterministic-algorithms setting."""

    def __init__(self, modules: list[nn.Module], options: CompileOptions) -> None:
        import torch._dynamo as dynamo
        from torch._dynamo.callback import CallbackTrigger

        self.modules, self.options = modules, options
        self._dynamo_trigger = CallbackTrigger.DYNAMO
        self._lock = threading.Lock()
        self._seconds, self._recompiles = 0.0, 0
        #: when the compiling in progress began (dynamo calls back for the outermost compile only)
        self._started: float | None = None
        self._deterministic = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
        )
        if options.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
            # deterministic mode would also fill every torch.empty with NaN: a cost, not determinism
            torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
        # a previous model's compiled code (a sweep's earlier job) would only fill the recompile limit
        dynamo.reset()
        self._baseline = _counters()
        dynamo.callback_handler.register_start_callback(self._on_start)
        dynamo.callback_handler.register_end_callback(self._on_end)
        for module in modules:
            module.compile(**options.compile_kwargs())

    def _on_start(self, args: Any) -> None:
        with self._lock:
            self._started = time.perf_counter()

    def _on_end(self, args: Any) -> None:
        with self._lock:
            if self._started is not None:
                self._seconds += time.perf_counter() - self._started
                self._started = None
            if args.callback_trigger == self._dynamo_trigger and _is_recompile(args.compile_id):
                self._recompiles += 1

    def stats(self) -> CompileStats:
        """What was compiled so far."""
        graphs, breaks = _counters()
        with self._lock:
            return CompileStats(self._seconds, graphs - self._baseline[0], breaks - self._baseline[1], self._recompiles)

    def close(self) -> None:
        """Stop counting; restore torch's deterministic-algorithms setting. Safe to call twice."""
        import torch._dynamo as dynamo

        handler = dynamo.callback_handler
        if self._on_start in handler.start_callbacks:
            handler.remove_start_callback(self._on_start)
            handler.remove_end_callback(self._on_end)
            enabled, warn_only, fill = self._deterministic
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
            torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]


def _is_recompile(compile_id: str) -> bool:
    """Whether dynamo's compile id (`frame/compile`, `!autograd/frame/compile`) is a frame's second or later compile."""
    parts = str(compile_id).lstrip("!").split("/")
    try:
        return int(parts[-1]) > 0
    except ValueError:
        return False


def compile_dense(model: nn.Module, options: CompileOptions, label: str) -> CompiledDense:
    """Compile the dense modules of `model` (the distributed model: the model's own module is
    found inside DMP / DDP) in place.

    Args:
        model: the model as the plan trains it.
        options: `trainer.compile_options`.
        label: the model's name, for the error.

    Raises:
        ConfigError: at `trainer.compile`, when no module of `model` names its dense submodules.
    """
    owners = [m for m in model.modules() if isinstance(m, DenseSubmodules)]
    if not owners:
        raise ConfigError(
            ConfigProblem(
                "trainer.compile",
                f"model '{label}' as built for this run has no module naming its dense modules to compile (a "
                "dense_modules() method: recsys_pipe.models.base.DenseSubmodules): give the model's module one, or "
                "set trainer.compile=false",
            )
        )
    return CompiledDense([m for owner in owners for m in owner.dense_modules()], options)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


@contextmanager
def compile_failures(compiled: CompiledDense | None) -> Iterator[None]:
    """Turn a torch.compile failure under `compiled` (raised by a task, in any thread) into a
    ConfigError naming the key: `trainer.compile_options.fullgraph` for a graph break under
    `fullgraph=true`, else `trainer.compile`. Nothing is caught without `compiled`."""
    if compiled is None:
        yield
        return
    from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException, Unsupported

    try:
        yield
    except Exception as exc:
        failure = next((e for e in _causes(exc) if isinstance(e, TorchDynamoException)), None)
        if failure is None:
            raise
        fullgraph = compiled.options.fullgraph and isinstance(failure, Unsupported)
        key = "trainer.compile_options.fullgraph" if fullgraph else "trainer.compile"
        shown = failure.inner_exception if isinstance(failure, BackendCompilerFailed) else failure  # the backend's
        first = next((line.strip() for line in str(shown).splitlines() if line.strip()), "")
        hint = "a graph break in a dense module; set it to false" if fullgraph else "set trainer.compile=false"
        raise ConfigError(
            ConfigProblem(key, f"torch.compile failed ({type(shown).__name__}: {first[:200]}): {hint}")
        ) from exc
