"""docs/first-plan.md is what a newcomer types first: its commands must run and print what it shows.

Every ```bash block of the page runs, in order, in a scratch directory with the package's
scripts on PATH, as a reader would after `source .venv/bin/activate`. Skipped: the install
(`scripts/setup.sh` made this environment) and the blocks that start a torchrun job or the
profiler (`scripts/...`, `recsys-profile`: tests/integration/test_cli_train.py and test_cli_profile.py cover
them). The block under "Break it on purpose" must exit 2 with the error lines the page shows;
every other block must exit 0, and the comparison must print that the losses are bitwise equal.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "first-plan.md"
SECTION = re.compile(r"^## (.+)$", re.MULTILINE)
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks() -> list[tuple[str, str, str]]:
    """(section title, language, body) of every fenced block, in page order."""
    text = PAGE.read_text(encoding="utf-8")
    found = []
    for match in BLOCK.finditer(text):
        titles = SECTION.findall(text[: match.start()])
        found.append((titles[-1] if titles else "", match.group(1), match.group(2)))
    return found


def runnable(body: str) -> bool:
    return "scripts/" not in body and "recsys-profile" not in body


def test_the_page_has_the_steps_a_newcomer_follows() -> None:
    bash = [body for _, lang, body in blocks() if lang == "bash"]
    joined = "\n".join(bash)
    for step in (
        "source .venv/bin/activate",
        "recsys-plan",
        "recsys-train",
        "pipeline=my_first_plan",
        "pipeline=serial",
    ):
        assert step in joined, f"first-plan.md no longer shows {step!r}"


def test_the_page_overwrites_no_tracked_file() -> None:
    """A reader follows the page at the repository root: the files it writes are not tracked."""
    written = re.findall(r"cat > (\S+)", "\n".join(body for _, lang, body in blocks() if lang == "bash"))
    assert written, "first-plan.md no longer writes a plan file"
    tracked = subprocess.run(["git", "ls-files", "--", *written], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    assert tracked.stdout == "", f"first-plan.md overwrites tracked files: {tracked.stdout.split()}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_command_of_first_plan_runs(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("OMP_NUM_THREADS", None)  # the page sets what it needs
    page = blocks()
    ran = 0
    for index, (section, lang, body) in enumerate(page):
        if lang != "bash" or not runnable(body) or section.startswith("0."):
            continue
        result = subprocess.run(
            ["bash", "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        output = result.stdout + result.stderr
        ran += 1
        if section.startswith("4."):  # break it on purpose: the errors the page shows, exit 2
            assert result.returncode == 2, output
            shown = next(b for _, lang2, b in page[index + 1 :] if lang2 == "")
            for line in shown.splitlines():
                if line.startswith("error:"):
                    assert line in output, f"first-plan.md shows {line!r}; the command printed:\n{output}"
            continue
        assert result.returncode == 0, f"block in '{section}' failed ({result.returncode}):\n{body}\n{output[-3000:]}"
        if "bitwise equal" in body:
            assert "losses bitwise equal: True" in output, output
    assert ran >= 5, f"only {ran} blocks of first-plan.md ran"
    assert (tmp_path / "my_conf" / "pipeline" / "my_first_plan.yaml").is_file()
    assert list((tmp_path / "runs" / "recsys-plan").glob("*/plan_dag.png")), "plot=true drew no picture"
