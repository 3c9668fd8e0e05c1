"""The docs state no fact the code contradicts: plans, config keys, and the API reference.

* Every plan file under `conf/pipeline/` is on docs/plans.md, the one page that lists them, and
  every plan that page's derivation tree names is a file there.
* Every config key the docs write as a dotted path (`trainer.max_steps`,
  `pipeline.tasks.h2d.options.inplace_copy=true`, `model.loss`) exists: in the config Hydra
  composes for some option of its group (a key of `model=sasrec` only exists with that choice,
  so the keys of a group are the union over its options), and below `pipeline.tasks.<task>` in
  the plan schema (`TASK_FIELDS`) and the task's registered `options` model.
* Every `recsys_pipe...` module or name, and every repository path (`tests/...`, `scripts/...`),
  the docs mention exists.
* Every public name the API reference documents has a docstring (the reference leaves out the
  undocumented ones, so an undocumented public name is a hole in it).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PLANS_PAGE = DOCS / "plans.md"
CONF = ROOT / "conf"
#: the groups whose options change which keys exist under the section of the same name
GROUPS = ("pipeline", "model", "data", "optimizer", "trainer")
#: the Hydra apps' primary configs (recsys-train, recsys-plan, recsys-profile)
PRIMARY_CONFIGS = ("config", "plan", "profile")


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


# -- the shipped plans are on the plans page ------------------------------------------------------


def plan_files() -> list[str]:
    return sorted(p.stem for p in (CONF / "pipeline").glob("*.yaml"))


def shipped_plans_section() -> str:
    text = PLANS_PAGE.read_text(encoding="utf-8")
    start = text.index("## The shipped plans")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def plans_in_tree(section: str) -> list[str]:
    """The first name on each line of the section's first code block (the derivation tree)."""
    tree = re.search(r"^```\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert tree, "docs/plans.md's 'The shipped plans' has no derivation tree (a plain ``` block)"
    return [m.group(1) for m in re.finditer(r"^[\s│├└]*(\w+)", tree.group(1), re.MULTILINE)]


def test_plans_page_names_every_plan_file() -> None:
    tree = plans_in_tree(shipped_plans_section())
    missing = [name for name in plan_files() if name not in tree]
    assert not missing, f"conf/pipeline/ has plans that docs/plans.md's 'The shipped plans' tree lacks: {missing}"
    unknown = [name for name in tree if name not in plan_files()]
    assert not unknown, f"docs/plans.md's plan tree names plans with no file in conf/pipeline/: {unknown}"


def test_plan_tree_parser_sees_every_line() -> None:
    section = "## The shipped plans\n```\nserial   x\n ├ base  y\n │  └ lite\n```\n"
    assert plans_in_tree(section) == ["serial", "base", "lite"]


# -- the config keys the docs name exist -----------------------------------------------------------

#: a dotted key: a root section, then identifiers or <placeholders>; not part of a longer dotted
#: name (recsys_pipe.data.batch), not a call (pipeline.enable_shortcut(...)), not a key added
#: with `+` (+model.hidden=8: a custom model's own key)
KEY = re.compile(r"(?<![\w./+-])([a-z_]+(?:\.(?:[A-Za-z_]\w*|<\w+>))+)(?![\w(])")
#: a line that shows a deliberately wrong key: an error message, or the command just above one
SHOWS_AN_ERROR = re.compile(r"error|unknown|did you mean|typo|misspel", re.IGNORECASE)
#: file names such as costs.json and model.txt look like keys
FILE_SUFFIXES = {"json", "jsonl", "txt", "png", "svg", "yaml", "yml", "md", "py", "csv", "log", "pt"}
#: dotted names that are not config keys although their first part is a section's name
NOT_KEYS = {"model.sparse_arch.embedding_bag_collection": "a module path in recsys-plan's printout"}


@cache
def composed(config_name: str, *overrides: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from recsys_pipe.testing import compose

    return OmegaConf.to_container(compose(*overrides, config_name=config_name), resolve=False)


def merge(into: dict[str, Any], tree: dict[str, Any]) -> None:
    for key, value in tree.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        elif isinstance(value, dict) or key not in into:
            into[key] = value


@cache
def key_tree() -> dict[str, Any]:
    """Every key of every primary config, merged over every option of every group."""
    tree: dict[str, Any] = {}
    for name in PRIMARY_CONFIGS:
        merge(tree, composed(name))
    for group in GROUPS:
        for option in sorted((CONF / group).glob("*.yaml")):
            merge(tree, {group: composed("config", f"{group}={option.stem}")[group]})
    tree.pop("hydra", None)
    # keys of sections that are null by default (`data.columns`): the schema's key listing, which
    # test_key_reference_page_lists_every_key_of_every_section holds to the schema
    from recsys_pipe.cli.key_reference import key_reference

    for listed in re.findall(r"^\| `([\w.<>]+)` \|", key_reference(), flags=re.MULTILINE):
        *path, last = listed.split(".")
        node = tree
        for part in path:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node.setdefault(last, None)
    return tree


@cache
def task_options() -> dict[str, set[str]]:
    """Task name -> the keys of its `options:`, for every task in a shipped plan or the registry."""
    from recsys_pipe.config import TASKS

    fns = {name: name for name in TASKS.names}
    fns.update({task: spec.get("fn", task) for task, spec in key_tree()["pipeline"]["tasks"].items()})
    found = {}
    for task, fn in fns.items():
        spec = TASKS.lookup(fn) if fn in TASKS else None
        found[task] = set(spec.options.model_fields) if spec is not None and spec.options is not None else set()
    return found


def key_problem(key: str) -> str | None:
    """Why `key` does not exist, or None when it does (`<name>` matches any key at its place)."""
    from recsys_pipe.config import TASK_FIELDS

    parts = key.split(".")
    if parts[:2] == ["pipeline", "tasks"] and len(parts) > 2:
        task, rest = parts[2], parts[3:]
        if not task.startswith("<") and task not in task_options():
            return f"no shipped plan and no registered task has a task {task!r}"
        if rest and rest[0] not in TASK_FIELDS:
            return f"{rest[0]!r} is not a task field ({', '.join(TASK_FIELDS)})"
        if (
            rest[:1] == ["options"]
            and len(rest) > 1
            and not task.startswith("<")
            and rest[1] not in task_options()[task]
        ):
            return f"task {task!r} has no option {rest[1]!r} (it has {sorted(task_options()[task])})"
        return None
    node: Any = key_tree()
    for depth, part in enumerate(parts):
        if part.startswith("<") and isinstance(node, dict):
            return None
        if isinstance(node, dict) and part not in node and "<name>" in node:  # an entry of a map of sections
            node = node["<name>"]
            continue
        if not isinstance(node, dict) or part not in node:
            return f"no key {part!r} under {'.'.join(parts[:depth]) or 'the config root'}"
        node = node[part]
    return None


def keys_in(line: str, roots: set[str]) -> list[str]:
    """The dotted config keys written on one line: those whose first part is a config section."""
    found = [m.group(1) for m in KEY.finditer(line)]
    return [
        key
        for key in found
        if key.split(".")[0] in roots and key.rsplit(".", 1)[1] not in FILE_SUFFIXES and key not in NOT_KEYS
    ]


def doc_keys() -> Iterator[tuple[str, int, str]]:
    """(page, line number, key) for every dotted config key the docs write, outside Python code
    (where `pipeline.observer` is an attribute) and outside the examples of wrong keys."""
    roots = set(key_tree())
    for page in doc_pages():
        lines = page.read_text(encoding="utf-8").splitlines()
        fence = None
        for number, line in enumerate(lines, 1):
            if line.startswith("```"):
                fence = None if fence is not None else line[3:].strip()
                continue
            following = lines[number] if number < len(lines) else ""
            if fence == "python" or SHOWS_AN_ERROR.search(line) or SHOWS_AN_ERROR.search(following):
                continue
            for key in keys_in(line, roots):
                yield str(page.relative_to(ROOT)), number, key


def test_every_config_key_in_the_docs_exists() -> None:
    found = list(doc_keys())
    assert len(found) > 100, f"only {len(found)} config keys found in the docs: the key pattern is broken"
    wrong = [f"{page}:{line}: {key}: {problem}" for page, line, key in found if (problem := key_problem(key))]
    assert not wrong, "the docs name config keys that do not exist:\n" + "\n".join(wrong)


def test_key_check_refuses_keys_that_do_not_exist() -> None:
    assert key_problem("trainer.max_steps") is None
    assert key_problem("model.loss") is None  # model=sasrec only
    assert key_problem("pipeline.tasks.h2d.options.inplace_copy") is None
    assert key_problem("pipeline.tasks.<name>.lookahead") is None
    assert key_problem("trainer.max_step") is not None
    assert key_problem("pipeline.tasks.h2d.lookahaed") is not None
    assert key_problem("pipeline.tasks.h2d.options.inplace") is not None
    assert key_problem("pipeline.tasks.h3d.stream") is not None
    assert key_problem("data.columns.labels") is None  # under a section that is null by default
    assert key_problem("data.columns.sparse.user.num_embeddings") is None  # a map's entry, named
    assert key_problem("data.columns.sparse.user.num_embedings") is not None
    assert key_problem("trainer.max_steps.x") is not None
    line = "`recsys-train trainer.max_steps=5 pipeline.tasks.h2d.lookahead=3 +model.x=1`, recsys_pipe.data.batch"
    line += ", costs.json, pipeline.enable_shortcut(names)"
    assert keys_in(line, {"trainer", "pipeline", "model"}) == ["trainer.max_steps", "pipeline.tasks.h2d.lookahead"]


# -- the modules, names and files the docs point to exist ------------------------------------------

#: `recsys_pipe.x.y` or `recsys_pipe.x:y`, not inside a longer name
DOTTED = re.compile(r"(?<![\w.])(recsys_pipe(?:\.\w+)+)(?::(\w+))?")
#: a repository path under one of these folders
REPO_PATH = re.compile(r"(?<![\w/.-])((?:tests|scripts|conf|recsys_pipe|docs)/[\w./-]*\w)")
#: what the docs name that is not a module or file of the repository
NOT_IN_REPO = {
    "recsys_pipe.tasks": "the entry-point group task plugins register under",
    "conf/pipeline/tuned.yaml": "the file a profiling example writes",
}


def resolves(dotted: str) -> bool:
    """Whether `dotted` is a module, or an attribute path below the longest importable module."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for attr in parts[end:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_module_name_and_repository_path_in_the_docs_exists() -> None:
    wrong = []
    for page in doc_pages():
        text = page.read_text(encoding="utf-8")
        where = page.relative_to(ROOT)
        for match in DOTTED.finditer(text):
            name = match.group(1) + (f".{match.group(2)}" if match.group(2) else "")
            if name not in NOT_IN_REPO and not resolves(name):
                wrong.append(f"{where}: {name}: no such module or attribute")
        for match in REPO_PATH.finditer(text):
            path = match.group(1)
            pattern = f"{path}*" if path.endswith("_") else path  # tests/test_engine_*: a prefix
            if path not in NOT_IN_REPO and not list(ROOT.glob(pattern)):
                wrong.append(f"{where}: {path}: no such file or folder")
    assert not wrong, "the docs name modules or files that do not exist:\n" + "\n".join(wrong)


def test_name_check_refuses_what_does_not_exist() -> None:
    assert resolves("recsys_pipe.train.tasks.h2d") and resolves("recsys_pipe.engine.Task.run")
    assert not resolves("recsys_pipe.train.tasks.h3d") and not resolves("recsys_pipe.trian")


# -- every public name of the API reference has a docstring ----------------------------------------


def reference_packages() -> list[str]:
    found = []
    for page in sorted((DOCS / "reference").glob("*.md")):
        found += re.findall(r"^::: (recsys_pipe[\w.]*)\s*$", page.read_text(encoding="utf-8"), re.MULTILINE)
    return found


def own_docstring(cls: type) -> str | None:
    """The class's own docstring: not inherited, and not the signature a dataclass writes."""
    doc = cls.__dict__.get("__doc__")
    if not doc or not doc.strip():
        return None
    if dataclasses.is_dataclass(cls) and doc.startswith(f"{cls.__name__}("):
        return None
    return doc


def undocumented(package: str) -> Iterator[str]:
    """The public names of `package` that have no docstring.

    Public: each name in the package's `__all__` that is a class or a function (constants are
    documented by their `#:` comment in the source, which the interpreter does not keep), and each
    public method and property a listed class defines itself (no leading underscore, not
    inherited). A class needs a docstring of its own; a method may take its base's, as
    `inspect.getdoc` does (an override of a documented protocol method says nothing new).
    """
    module = importlib.import_module(package)
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj):
            if own_docstring(obj) is None:
                yield f"{package}.{name} ({obj.__module__})"
            for member, value in vars(obj).items():
                if member.startswith("_"):
                    continue
                if isinstance(value, property):
                    doc = inspect.getdoc(value)
                elif inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod)):
                    doc = inspect.getdoc(getattr(obj, member))
                else:
                    continue
                if not doc:
                    yield f"{package}.{name}.{member} ({obj.__module__})"
        elif inspect.isfunction(obj) and not inspect.getdoc(obj):
            yield f"{package}.{name} ({obj.__module__})"


def test_reference_covers_the_public_packages() -> None:
    assert {"recsys_pipe.engine", "recsys_pipe.train", "recsys_pipe.config"} <= set(reference_packages())


@pytest.mark.parametrize("package", reference_packages())
def test_every_public_name_of_the_reference_has_a_docstring(package: str) -> None:
    missing = list(undocumented(package))
    assert not missing, f"{len(missing)} public names of {package} have no docstring:\n" + "\n".join(missing)


def test_docstring_count_sees_an_undocumented_name() -> None:
    class Documented:
        """Has one."""

        def method(self) -> None:
            pass

    assert own_docstring(Documented) and not inspect.getdoc(Documented.method)

    @dataclasses.dataclass
    class Generated:
        x: int

    assert own_docstring(Generated) is None


# -- each model's default data and plan are what extending.md's table says ----------------------


def model_table() -> list[tuple[str, str, str]]:
    """(model option, default data, default plan) of each row of extending.md's `model=` table."""
    text = (DOCS / "extending.md").read_text(encoding="utf-8")
    start = text.index("| `model=` | what | tables | default data | default plan |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        first = lambda cell: (re.findall(r"`(\w+)`", cell) or [""])[0]
        rows.append((first(cells[0]), first(cells[3]), first(cells[4])))
    assert len(rows) == len(list((CONF / "model").glob("*.yaml"))), rows  # a row per model option
    return rows


@pytest.mark.parametrize("model, data, plan", model_table())
def test_model_table_states_each_models_default_data_and_plan(model, data, plan) -> None:
    from recsys_pipe.cli import compose_config

    cfg = compose_config(f"model={model}")
    assert cfg.pipeline.name == plan
    if data:
        assert cfg.data.name == data


def test_hstu_prefetch_still_validates_for_every_model(tmp_path) -> None:
    from recsys_pipe.testing import load_run
    from recsys_pipe.train.plan import training_plan

    (tmp_path / "seq.txt").write_text("".join(f"{u} {i}\n" for u in range(1, 9) for i in range(u, u + 4)))
    for model in ("dlrm", "dlrm_dcn", "dlrm_torch", "sasrec", "hstu_retrieval", "hstu_small"):
        run = load_run(
            f"model={model}",
            "pipeline=hstu_prefetch",
            f"data.path={tmp_path / 'seq.txt'}" if model in ("sasrec", "hstu_retrieval") else "trainer.max_steps=1",
        )
        assert training_plan(run).config.name == "hstu_prefetch"


# -- the key reference lists every key of the schema ---------------------------------------------


def test_key_reference_page_lists_every_key_of_every_section() -> None:
    from recsys_pipe.cli.key_reference import key_reference

    page = (DOCS / "reference" / "keys.md").read_text(encoding="utf-8")
    assert page == key_reference(), (
        "docs/reference/keys.md is not the schema's key listing: regenerate it with "
        "python -m recsys_pipe.cli.key_reference > docs/reference/keys.md"
    )
    for key in ("data.num_workers", "optimizer.weight_decay", "model.relative_bias", "pipeline.thread_map.map"):
        assert f"| `{key}` |" in page


def test_failures_page_counts_the_catalogue() -> None:
    import ast

    source = (ROOT / "tests" / "integration" / "test_failures.py").read_text(encoding="utf-8")
    (catalogue,) = [
        node.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "CATALOGUE"
    ]
    page = (DOCS / "operations" / "failures.md").read_text(encoding="utf-8")
    assert f"\n{len(catalogue.elts)} bad inputs through `recsys-train`" in page
