"""Where the packaged config tree lives (the one definition every reader of it imports), and
the home-directory expansion every path key of the config gets (`home_expanded`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["CONF_DIR", "home_expanded"]

#: The packaged config tree (the repo-root `conf` is a symlink to it).
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def home_expanded(value: Any) -> Any:
    """A path key's value with a leading `~` (or `~user`) expanded, as a shell would (a URI and
    anything not a string are left as they are; a list item by item): the validator of every
    path key, so `data.path=~/x.parquet` and `output_dir: ~/runs` name the home directory."""
    if isinstance(value, list):
        return [home_expanded(v) for v in value]
    if isinstance(value, str) and value.startswith("~"):
        return os.path.expanduser(value)
    return value
