"""Print the requirements a pyproject.toml declares (dependencies plus the chosen extras), one
per line, leaving out the named distributions: scripts/setup.sh installs those its own way on a
machine without CUDA (CPU wheels, torchrec without its dependency list).

    python scripts/requirements.py pyproject.toml --extras test,docs --without torch torchrec
"""

from __future__ import annotations

import argparse
import re

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the TOML reader pip itself ships
    from pip._vendor import tomli as tomllib


def requirements(pyproject: str, extras: list[str], without: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    found = list(project.get("dependencies", []))
    for extra in extras:
        found += project.get("optional-dependencies", {})[extra]
    skip = {_normal(name) for name in without}
    return [req for req in found if _normal(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0]) not in skip]


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject")
    parser.add_argument("--extras", default="", help="comma-separated extras to include")
    parser.add_argument("--without", nargs="*", default=[], help="distributions to leave out")
    args = parser.parse_args()
    print("\n".join(requirements(args.pyproject, [e for e in args.extras.split(",") if e], args.without)))


if __name__ == "__main__":
    main()
