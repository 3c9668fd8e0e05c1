"""Module boundaries, read from the source (AST): private modules stay inside their package,
Hydra's internals inside one adapter, and no two modules of recsys_pipe import each other."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import recsys_pipe

PACKAGE = Path(recsys_pipe.__file__).parent
ROOT = PACKAGE.parent
SOURCES = sorted(PACKAGE.rglob("*.py"))
TESTS = sorted((ROOT / "tests").rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SOURCES}


@functools.cache
def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import, at any depth: module level, inside functions and
    under `if TYPE_CHECKING:` (a type-only import still ties the two modules together).
    `from a.b import c` counts as `a.b` and, when `a.b.c` is a module, as `a.b.c` too."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found.extend(
                (node.lineno, f"{node.module}.{a.name}") for a in node.names if f"{node.module}.{a.name}" in MODULES
            )
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_no_private_module_is_imported_from_outside_its_package():
    """A private module of ours, `recsys_pipe...pkg._mod`, may be imported by modules inside `pkg`
    (its subpackages included), nowhere else: not by another package, not by the tests.
    `recsys_pipe._lazy` (the PEP 562 helper of the package namespaces) is used by
    `recsys_pipe.data`, `.models`, `.runtime` and `.train`: inside `recsys_pipe`, so allowed.
    (Other libraries' private modules are not ours to police here; Hydra's are confined to one
    adapter, see below. The tests' own helpers, `tests/_schedules.py`, are the tests' package.)"""
    bad = []
    for path in SOURCES + TESTS:
        importer = _module_name(path) if path.is_relative_to(PACKAGE) else None
        for line, module in _imports(path):
            if module.split(".")[0] != "recsys_pipe":
                continue
            parts = module.split(".")
            for i, part in enumerate(parts):
                if part.startswith("_") and not part.startswith("__"):
                    package = ".".join(parts[:i])
                    if importer is None or not (importer == package or importer.startswith(f"{package}.")):
                        bad.append(f"{path.relative_to(ROOT)}:{line}: {module}")
                    break
    assert not bad, "private modules imported from outside their package: " + ", ".join(bad)


def test_hydra_internals_are_used_by_one_adapter_only():
    """`hydra._internal` and `hydra.core` (ConfigStore, GlobalHydra, HydraConfig, the override
    parser) are used in `recsys_pipe.cli.hydra_adapter` and nowhere else."""
    adapter = PACKAGE / "cli" / "hydra_adapter.py"
    users = sorted(
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in SOURCES + TESTS
        for line, module in _imports(path)
        if path != adapter and module.startswith(("hydra._internal", "hydra.core"))
    )
    assert not users, "Hydra internals outside cli/hydra_adapter.py: " + ", ".join(users)
    assert any(m.startswith("hydra._internal") for _, m in _imports(adapter))  # the check sees imports


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    """recsys_pipe module -> the recsys_pipe modules it imports (module level, inside functions and
    under TYPE_CHECKING: `_imports`). Importing `a.b.c` runs `a` and `a.b` first, but those edges are left
    out: a package's `__init__` re-exporting its submodules is not a circle of design."""
    return {
        name: {m for _, m in _imports(path) if m in MODULES and m != name} for name, path in sorted(MODULES.items())
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


#: Circles of imports kept on purpose: the sorted module names, and why no one-way split removes it.
ALLOWED_CYCLES: dict[tuple[str, ...], str] = {
    ("recsys_pipe.engine.context", "recsys_pipe.engine.task"): (
        "type annotations only, both under TYPE_CHECKING (nothing is imported at run time): a task's "
        "function takes the context, fn(ctx: TaskContext), and the context carries the task it runs, "
        "ctx.task: Task; the two types describe each other, so neither module can sit below the other"
    ),
}


def test_no_import_cycles_among_recsys_pipe_modules():
    cycles = [c for c in _cycles(_import_graph()) if tuple(c) not in ALLOWED_CYCLES]
    assert not cycles, f"modules importing each other (split the shared piece into a lower module): {cycles}"


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# -- layers: packages, and the one door of pipeline parallelism ------------------------------------


def _package(module: str) -> str:
    """The top-level package of a recsys_pipe module (`recsys_pipe.train.build` -> `train`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _package_graph() -> dict[str, set[str]]:
    """recsys_pipe package -> the packages its modules import (`_import_graph`, folded)."""
    graph: dict[str, set[str]] = {}
    for importer, imported in _import_graph().items():
        graph.setdefault(_package(importer), set())
        for module in imported:
            if _package(module) != _package(importer):
                graph[_package(importer)].add(_package(module))
                graph.setdefault(_package(module), set())
    return graph


def test_no_two_packages_import_each_other():
    """Packages form layers: no circle of imports between two packages (`train` -> `pp` -> `train`
    would be one), even when no two modules of them import each other."""
    cycles = _cycles(_package_graph())
    assert not cycles, f"packages importing each other (move the shared piece into a lower package): {cycles}"


def test_the_package_cycle_check_sees_a_cycle_of_modules_in_different_packages():
    graph = {"recsys_pipe.a.x": {"recsys_pipe.b.y"}, "recsys_pipe.b.z": {"recsys_pipe.a.w"}}
    folded: dict[str, set[str]] = {}
    for importer, imported in graph.items():
        folded.setdefault(_package(importer), set()).update(_package(m) for m in imported)
    assert _cycles(folded) == [["a", "b"]]


# The three homes of pipeline parallelism, as docs/design.md (section 1) gives them: the schedules
# as data (`pp_schedules`, a leaf), the stage runtime (`pp`) and the training loop's door to it
# (`train/parallel/`). The tests below hold each sentence of that paragraph.

#: what the stage runtime may import: the schedules, the models that cut themselves into stages,
#: the config and the engine (and the lazy-export helper of its namespace)
PP_MAY_IMPORT = {"pp", "pp_schedules", "models", "config", "engine", "_lazy"}
#: the packages besides train's door that may import the stage runtime: the benchmarks (the top)
PP_IMPORTED_BY = {"pp", "train", "bench"}


def _packages_imported_by(package: str) -> set[str]:
    return {
        _package(m) for importer, imported in _import_graph().items() if _package(importer) == package for m in imported
    }


def test_the_schedules_are_a_leaf_the_analysis_may_import():
    """`recsys_pipe.pp_schedules` imports no other package of ours; `autosched` imports it but
    never the stage runtime `pp`."""
    leaf = _packages_imported_by("pp_schedules") - {"pp_schedules"}
    assert not leaf, f"recsys_pipe.pp_schedules imports {sorted(leaf)}"
    analysis = _packages_imported_by("autosched")
    assert "pp" not in analysis, "recsys_pipe.autosched imports the stage runtime"
    assert "pp_schedules" in analysis  # the check sees imports


def test_the_pipeline_runtime_imports_only_schedules_models_config_and_engine():
    """`recsys_pipe.pp` runs pipeline stages; it imports `pp_schedules`, `models`, `config` and
    `engine`, never `train` (which reaches it through `train.parallel`), `autosched`, `data` or
    `runtime`."""
    assert _packages_imported_by("pp") <= PP_MAY_IMPORT, sorted(_packages_imported_by("pp") - PP_MAY_IMPORT)


def test_train_reaches_pipeline_parallelism_through_train_parallel_only():
    """Within `train` and `cli`, only `train/parallel/` imports `pp` or `pp_schedules`; apart from
    `bench` (the top) no other package imports `pp`."""
    bad = sorted(
        f"{importer} imports {module}"
        for importer, imported in _import_graph().items()
        for module in imported
        if _package(module) in ("pp", "pp_schedules")
        and (
            (_package(importer) in ("train", "cli") and not importer.startswith("recsys_pipe.train.parallel"))
            or (_package(module) == "pp" and _package(importer) not in PP_IMPORTED_BY)
        )
    )
    assert not bad, bad
    assert any(m.startswith("recsys_pipe.pp.") for m in _import_graph()["recsys_pipe.train.parallel.stages"])


#: how this project's pipeline parallelism is spelled in code: its package, its config section,
#: its types and helpers. (megatron-core's own "pipeline-parallel size", which `dense_ddp` sets
#: to 1, is another library's setting, not ours.)
PP_WORDS = re.compile(
    r"recsys_pipe\.pp\b|parallel\.pp\b|\bpp\b|is_pipelined|Pipelined(Model)?\b|pipelined_tables|PipelineStages"
    r"|pipeline stages?\b|pipeline parallel"
)


def test_train_and_cli_mention_pipeline_parallelism_only_behind_its_seam():
    """The loop, the commands and the other implementations never ask whether pipeline
    parallelism is on: outside `recsys_pipe/train/parallel/` (the seam and its implementations),
    `train/` and `cli/` do not mention it, in code or comments."""
    seam = PACKAGE / "train" / "parallel"
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for package in ("train", "cli")
        for path in sorted((PACKAGE / package).rglob("*.py"))
        if not path.is_relative_to(seam)
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if PP_WORDS.search(line)
    ]
    assert not found, "pipeline parallelism outside train/parallel/:\n" + "\n".join(found)
    assert PP_WORDS.search("from recsys_pipe.pp.train import x") and PP_WORDS.search("run.parallel.pp.size")


# -- the commands reach training through its check and build entry points ---------------------------

#: what the start-up path of the training commands may import from `train`: the run config (the
#: commands' configs derive from it), the pre-flight (`check_plan`, `check_run`, and the build
#: entry point `CheckedRun.build`), and the types the commands' work receives (`Trainer`, and
#: `progress` for how a fit ended)
STARTUP_MAY_IMPORT = {
    "recsys_pipe.train",
    "recsys_pipe.train.config",
    "recsys_pipe.train.preflight",
    "recsys_pipe.train.progress",
}


def test_the_training_commands_reach_train_through_its_check_and_build_entry_points():
    """cli/ keeps run directories, Hydra and supervision: `recsys-train`'s and `recsys-profile`'s
    start-up (`cli/launch.py`, `cli/train.py`, `cli/profile.py`) check a run with train's
    pre-flight and have train build it; they never assemble it from train's parts themselves."""
    startup = ("recsys_pipe.cli.launch", "recsys_pipe.cli.train", "recsys_pipe.cli.profile")
    graph = _import_graph()
    bad = sorted(
        f"{importer} imports {module}"
        for importer in startup
        for module in graph[importer]
        if _package(module) == "train" and module not in STARTUP_MAY_IMPORT
    )
    assert not bad, bad
    assert "recsys_pipe.train.preflight" in graph["recsys_pipe.cli.launch"]  # the check sees imports


# -- the data package's contracts, private names and import paths in strings ----------------------

#: what models, the stage runtime and train import of `recsys_pipe.data`: the package's public
#: names, the batch contract, the source contract and the registry of sources
DATA_CONTRACTS = {"recsys_pipe.data", "recsys_pipe.data.batch", "recsys_pipe.data.source", "recsys_pipe.data.registry"}


def test_models_pp_and_train_import_data_through_its_contracts_only():
    """Batches, their keys and `DataSpec` come from `recsys_pipe.data.batch`, config bases from
    `recsys_pipe.data.source` (or `recsys_pipe.data`): never from the sources that make them."""
    bad = sorted(
        f"{importer} imports {module}"
        for importer, imported in _import_graph().items()
        if _package(importer) in ("models", "pp", "train")
        for module in imported
        if _package(module) == "data" and module not in DATA_CONTRACTS
    )
    assert not bad, bad


def _private_imports(source: str) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from recsys_pipe... import _name` in `source`, at any depth."""
    return [
        (node.lineno, node.module, alias.name)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("recsys_pipe")
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


def test_no_module_imports_another_modules_private_names():
    """A name with a leading underscore is its module's own: another module that needs it gets it
    made public (or the shared piece moves to a module both import)."""
    bad = [
        f"{path.relative_to(ROOT)}:{line}: from {module} import {name}"
        for path in SOURCES
        for line, module, name in _private_imports(path.read_text())
        if f"{module}.{name}" not in MODULES  # a private module is the first test's subject
    ]
    assert not bad, bad
    probe = "def f():\n    from recsys_pipe.models.hstu import _x, y\n"
    assert _private_imports(probe) == [(2, "recsys_pipe.models.hstu", "_x")]


#: `recsys_pipe.pkg.module` or `recsys_pipe.pkg.module:attr`, as a string constant (an import path)
IMPORT_PATH = re.compile(r"recsys_pipe(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?")


def _above(graph: dict[str, set[str]], low: str, high: str) -> bool:
    """Whether package `high` imports package `low`, directly or through others."""
    seen, todo = set(), [high]
    while todo:
        package = todo.pop()
        for imported in graph.get(package, ()):
            if imported == low:
                return True
            if imported not in seen:
                seen.add(imported)
                todo.append(imported)
    return False


def test_no_string_import_path_points_up_the_layers():
    """A string that names a module to import later (`"pkg.module:function"`, a registry entry, a
    task module) names one in its own package or below it, never above: models name their own
    stage cuts, train names its own task modules (docstrings and comments are prose)."""
    graph = _package_graph()
    bad = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        importer = _package(_module_name(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docstrings:
                continue
            if IMPORT_PATH.fullmatch(node.value):
                named = _package(node.value.split(":")[0])
                if named != importer and _above(graph, importer, named):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r} ({importer} -> {named})")
    assert not bad, bad
    assert _above({"train": {"models"}, "models": {"data"}}, "data", "train")
