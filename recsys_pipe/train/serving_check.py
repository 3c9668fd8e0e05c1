"""Check exports as a serving process sees them: `python -I serving_check.py OUT [OUT ...]`.

Run in a fresh interpreter by `recsys-export` (`recsys_pipe.train.export.verify_exports`), after
it wrote OUT and before it reports success, so what is checked is the saved files, not the
program in the exporter's memory. Here `recsys_pipe`, torchrec and fbgemm-gpu cannot be imported
(a finder refuses them): an export that needs any of them fails here; `loaded` names any of them
or pyarrow that was imported nonetheless. For each OUT:

* `program.pt2` (`torch.export.load`) scores `example_inputs.pt`; the largest difference from
  `expected_scores.pt` is `program_diff` (retrieval: the user vectors against `item_table.pt`'s
  rows of the candidates);
* `preprocess.py` (imported from OUT) turns `raw_example.jsonl` into inputs: whether they equal
  `example_inputs.pt` (`inputs_match`, `mismatch` names the first that differs) and the
  difference of the program's scores of them (`raw_diff`).

Prints one JSON line: a list with one record per OUT. Imports only the standard library and torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

BLOCKED = {"recsys_pipe", "torchrec", "fbgemm_gpu"}
#: not blocked (torch imports some optional modules under try), but reported if anything loaded them
WATCHED = {*BLOCKED, "pyarrow"}


class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} cannot be imported where an export is served")
        return None


def _scores(program: Any, inputs: dict[str, Any], expected: dict[str, Any], table: Any) -> Any:
    out = program(*inputs.values())
    if table is None:
        return out
    return (out[:, None, :] * table[expected["candidates"]]).sum(-1)


def _diff(a: Any, b: Any) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def check(out: Path, number: int) -> dict[str, Any]:
    """The record of one export directory (see the module docstring)."""
    import torch

    program = torch.export.load(str(out / "program.pt2")).module()
    inputs = torch.load(out / "example_inputs.pt")
    expected = torch.load(out / "expected_scores.pt")
    table = torch.load(out / "item_table.pt") if (out / "item_table.pt").is_file() else None
    spec = importlib.util.spec_from_file_location(f"_preprocess_{number}", out / "preprocess.py")
    assert spec is not None and spec.loader is not None
    preprocess = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preprocess)
    features = preprocess.load_features(out / "features.json")
    rows = [json.loads(line) for line in (out / "raw_example.jsonl").read_text().splitlines() if line.strip()]
    made = preprocess.inputs(rows, features)
    mismatch = next(
        (
            name
            for name in inputs
            if name not in made or made[name].shape != inputs[name].shape or not torch.equal(made[name], inputs[name])
        ),
        None,
    )
    with torch.no_grad():
        program_diff = _diff(_scores(program, inputs, expected, table), expected["scores"])
        raw_diff = _diff(_scores(program, made, expected, table), expected["scores"]) if mismatch is None else None
    return {
        "out": str(out),
        "program_diff": program_diff,
        "raw_diff": raw_diff,
        "inputs_match": mismatch is None and list(made) == list(inputs),
        "mismatch": mismatch,
    }


def main(argv: list[str]) -> None:
    sys.meta_path.insert(0, _Blocked())
    records = [check(Path(out), number) for number, out in enumerate(argv)]
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in WATCHED)
    for record in records:
        record["loaded"] = loaded
    print(json.dumps(records))


if __name__ == "__main__":
    main(sys.argv[1:])
