"""Layering of the schedule tooling: only the engine's public API, the pipeline-parallel
schedules as data (`recsys_pipe.pp_schedules`, a leaf), the standard library, numpy and
matplotlib."""

import ast
import pathlib
import sys

import recsys_pipe.autosched as autosched

ALLOWED_THIRD_PARTY = {"numpy", "matplotlib"}


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.lineno, node.module


def test_autosched_imports_only_the_engine_api_stdlib_numpy_and_matplotlib():
    root = pathlib.Path(autosched.__file__).parent
    bad = []
    for path in sorted(root.glob("*.py")):
        for line, module in _imports(path):
            top = module.split(".")[0]
            ok = (
                module == "__future__"
                or top in sys.stdlib_module_names
                or top in ALLOWED_THIRD_PARTY
                or module == "recsys_pipe.engine"  # the public API, not its modules
                or module.startswith("recsys_pipe.autosched")
                or module.startswith("recsys_pipe.pp_schedules")  # the schedules as data: a leaf
            )
            if not ok:
                bad.append(f"{path.name}:{line}: {module}")
    assert not bad, "autosched may import only the engine API, stdlib, numpy, matplotlib: " + ", ".join(bad)


def test_autosched_uses_only_engine_names_that_stay():
    # the engine's test-only helpers are being removed; these are the names autosched relies on
    stable = {
        "DEFAULT_STREAM",
        "compile_dependencies",
        "cpu_edges",
        "fires",
        "resolve_thread_map",
        "TaskGraph",
        "TaskGroup",
        "Task",
        "DependencyGraph",
        "Dependency",
        "EventWait",
        "Edge",
        "TaskGraphValidationError",
        "DependencyCycleError",
        # the profiler: an observer on a running plan runner, and the shortcut eligibility rule
        "PlanRunner",
        "SpanRecorder",
        "shortcut_refusal",
    }
    root = pathlib.Path(autosched.__file__).parent
    used = set()
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "recsys_pipe.engine":
                used |= {alias.name for alias in node.names}
    assert used <= stable, sorted(used - stable)
