"""The reference page of every config key (`docs/reference/keys.md`), generated from the schema.

    python -m recsys_pipe.cli.key_reference > docs/reference/keys.md

Why generated: the keys, their defaults and descriptions are the pydantic schema's (what `--help`
prints); a hand-kept table drifted (about 20 keys were in `--help` only). A test regenerates the
page and compares, so a new key without its row fails the suite.
"""

from __future__ import annotations

from omegaconf import OmegaConf, open_dict

from recsys_pipe.cli.compose import compose_config
from recsys_pipe.cli.keys import describe_keys
from recsys_pipe.cli.schemas import register_schemas
from recsys_pipe.config import CONF_DIR, import_fn

__all__ = ["key_reference"]

#: groups whose option decides the section's keys: one table per option
COMPONENT_GROUPS = ("model", "data", "optimizer")
#: the other sections, one table each (the default options' values)
SECTIONS = ("trainer", "parallel", "pipeline")
RUN_CONFIG = "recsys_pipe.train.config:RunConfig"

HEADER = """# Every config key

Every key of `recsys-train`'s config (`recsys-plan` and `recsys-profile` read the same tree),
with its default and what it does: the schema's own descriptions, as `recsys-train --help`
prints them. A component's section has the keys of the chosen option (`model=dlrm`,
`data=movielens`, `optimizer=sgd`): one table per option. Overrides take the dotted path,
`recsys-train optimizer.weight_decay=0.01`. `???`: a value you must set.

This page is generated (`python -m recsys_pipe.cli.key_reference > docs/reference/keys.md`);
a test checks that it lists every key of the schema.
"""


def _rows(*overrides: str) -> list[tuple[str, str, str]]:
    cfg = compose_config(*overrides)
    with open_dict(cfg):
        del cfg["hydra"]
    return describe_keys(import_fn(RUN_CONFIG), OmegaConf.to_container(cfg, resolve=False))


def _table(rows: list[tuple[str, str, str]], section: str) -> str:
    lines = ["| key | default | description |", "|---|---|---|"]
    for path, value, description in rows:
        if path == section or not (path.startswith(section + ".") or (section == "" and "." not in path)):
            continue
        if not value and not description:  # a sub-section's own row: its keys follow
            continue
        default = f"`{_escape(value)}`" if value else ""
        lines.append(f"| `{path}` | {default} | {_escape(description)} |")
    return "\n".join(lines)


def _escape(text: str) -> str:
    """A table cell's text: `|` would end the cell."""
    return text.replace("|", "\\|")


def key_reference() -> str:
    """The Markdown of docs/reference/keys.md."""
    register_schemas()
    parts = [HEADER]
    defaults = _rows()
    for section in SECTIONS:
        parts.append(f"## `{section}`\n\n{_table(defaults, section)}\n")
    parts.append(f"## Top level\n\n{_table(defaults, '')}\n")
    for group in COMPONENT_GROUPS:
        for option in sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")):
            rows = _rows(f"{group}={option}")
            parts.append(f"## `{group}={option}`\n\n{_table(rows, group)}\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(key_reference(), end="")
