"""Where the packaged config tree lives: the one definition every reader of it imports."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CONF_DIR"]

#: The packaged config tree (the repo-root `conf` is a symlink to it).
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
