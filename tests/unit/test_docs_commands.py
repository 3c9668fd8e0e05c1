"""Every command in README.md and docs/ runs in a test or is marked illustrative.

A command of `recsys-train`, `recsys-plan` or `recsys-profile` (typed as such, under torchrun, or
through scripts/train.sh and scripts/profile.sh) has its config checked here as the command
checks it before it starts (`HydraApp._check_job`: composition, every key and value, the plan):
only a data file or checkpoint it names may be missing (`/data/...`: the reader's own). Any other
command is run by the test `RUN_BY` names for it. A block of commands that needs what a test
machine does not have (a GPU, several nodes, your data, a long run) is marked with an HTML comment
`<!-- illustrative: <why> -->` on the line before its fence, and so is a block whose commands hold
placeholders (`...`, `<run dir>`, `$COSTS`).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
COMMAND = re.compile(r"^((recsys-\w+|torchrun|python|bash)(\s|$)|scripts/|NPROC=|OMP_|pip |\./|git |mkdocs|srun)")
CONFIG_COMMANDS = {"recsys-train": "train", "recsys-plan": "plan", "recsys-profile": "profile"}
SCRIPTS = {"scripts/train.sh": "recsys-train", "scripts/profile.sh": "recsys-profile"}
#: command (its start) -> the test that runs it: `file::function`
RUN_BY = {
    "bash scripts/setup.sh": ".ci/run (CI sets up the fresh clone through it)",
    "scripts/test.sh": ".ci/run (CI runs the suite through it)",
    "recsys-data convert sequences clicks.txt out/ --delimiter ';'": (
        "tests/unit/test_data_convert.py::test_text_ids_are_numbered_and_their_texts_kept"
    ),
    "recsys-data convert criteo day_0 out/": (
        "tests/unit/test_data_convert.py::test_convert_criteo_writes_the_rows_as_parsed"
    ),
    "recsys-export": "tests/integration/test_export_layouts.py::test_the_cli_verifies_and_refuses_a_used_output",
    "recsys-eval": "tests/integration/test_export.py::test_recsys_eval_of_a_retrieval_run_gives_both_protocols",
    "python -m recsys_pipe.runtime.launcher --standalone --nproc_per_node 2 --no-python recsys-eval": (
        "tests/integration/test_export.py::test_recsys_eval_on_two_ranks_equals_the_logged_evaluation"
    ),
    "recsys-bench raw_ids": (
        "tests/integration/test_bench_raw_ids.py::test_bench_raw_ids_quick_reports_every_variant_side_by_side"
    ),
    "recsys-bench pp": (
        "tests/integration/test_pp_bench.py::test_bench_pp_quick_reports_every_schedule_and_draws_gantts"
    ),
    "scripts/gpu_check.sh": (
        "tests/integration/test_gpu_scripts.py::test_gpu_check_without_a_gpu_says_so_and_runs_nothing"
    ),
}
#: a page whose commands a test runs as the page has them, in order
PAGE_RUN_BY = {"docs/first-plan.md": "tests/integration/test_docs_first_plan.py::test_every_command_of_first_plan_runs"}


def _commands() -> list[tuple[str, int, str, bool, list[str]]]:
    """(page, line, command, illustrative, the `error:` lines its block shows) of every command of
    every shell block."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = re.match(r"^```(\w*)\s*$", lines[i].strip())
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            marked = i > 0 and lines[i - 1].strip().startswith("<!-- illustrative")
            if fence.group(1) in ("", "bash", "sh", "console", "shell"):
                body = "\n".join(lines[i + 1 : end]).replace("\\\n", " ")
                errors = [
                    line.strip().removeprefix("error: ") for line in body.splitlines() if line.startswith("error: ")
                ]
                for number, line in enumerate(body.splitlines(), i + 2):
                    text = line.strip().removeprefix("$ ")
                    if COMMAND.match(text):
                        found.append((str(page.relative_to(ROOT)), number, text, marked, errors))
            i = end + 1
    return found


def _world(command: str) -> str:
    """The ranks a command starts (torchrun's, scripts/train.sh's `--nproc_per_node`/NPROC), as the
    check sees them (`WORLD_SIZE`, as scripts/train.sh sets it for its check)."""
    found = re.search(r"(?:--nproc_per_node[ =]|NPROC=)(\d+)", command)
    if found:
        return found.group(1)
    return "2" if re.search(r"(^|\s)scripts/(train|profile)\.sh", command) else "1"


def _overrides(command: str) -> tuple[str, list[str]] | None:
    """(the CLI, its arguments) of a config command, else None."""
    words = shlex.split(command.split("  #")[0].split(" # ")[0])
    while words and "=" in words[0] and not words[0].startswith(("recsys", "scripts")):
        words = words[1:]  # NPROC=1 ...
    for at, word in enumerate(words):
        name = SCRIPTS.get(word, word.rsplit("/", 1)[-1])
        if name in CONFIG_COMMANDS:
            return name, words[at + 1 :]
    return None


ALLOWED = ("no such file", "no such checkpoint", "is a directory", "matches no file", "cannot open")


def _check(cli: str, args: list[str]) -> list[str]:
    """The problems of the command's config that its data files' absence does not explain (all
    of them: `str(problem)`)."""
    from recsys_pipe.cli.hydra_adapter import sweep_jobs
    from recsys_pipe.config import CONF_DIR

    module = {"recsys-train": "train", "recsys-plan": "plan", "recsys-profile": "profile"}[cli]
    app = __import__(f"recsys_pipe.cli.{module}", fromlist=["_app"])._app
    flags = [a for a in args if a.startswith("-")]
    overrides = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] != "--cfg")]
    if "--help" in flags:
        return []
    if "-m" in flags:
        overrides = sweep_jobs(overrides)[0]
    error = app._check_job([], overrides, app.config_name, [CONF_DIR], "--cfg" not in flags, set())
    problems = [] if error is None else error.problems
    return [str(p) for p in problems if not any(a in p.message for a in ALLOWED)]


@pytest.mark.timeout(300)
def test_every_command_runs_in_a_test_or_is_illustrative(capsys, monkeypatch):
    unchecked, failing, untested = [], [], []
    for page, line, command, marked, errors in _commands():
        where = f"{page}:{line}: {command}"
        if marked:
            continue
        owner = PAGE_RUN_BY.get(page)
        config = _overrides(command)
        if config is not None and owner is None:
            world = _world(command)
            monkeypatch.setenv("WORLD_SIZE", world)
            monkeypatch.setenv("RANK", str(int(world) - 1))
            problems = _check(*config)
            if problems != errors:  # a refused config's block shows its error lines
                failing.append(f"{where}: {problems} (the page shows {errors})")
            continue
        owner = owner or next((RUN_BY[k] for k in RUN_BY if command.startswith(k)), None)
        if owner is None:
            untested.append(where)
        elif "::" in owner:
            file, test = owner.split("::")
            if f"def {test}(" not in (ROOT / file).read_text():
                unchecked.append(f"{where}: {owner} does not exist")
    capsys.readouterr()
    assert not failing, "\n".join(failing)
    assert not untested, "run it in a test (RUN_BY) or mark its block illustrative:\n" + "\n".join(untested)
    assert not unchecked, "\n".join(unchecked)
