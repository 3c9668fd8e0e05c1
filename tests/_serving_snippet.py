"""The serving snippet of docs/operations/serving.md, run on an export in a fresh interpreter where
recsys_pipe, torchrec and fbgemm cannot be imported (test_export, test_raw_ids)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: prepended to the docs' serving snippet: recsys_pipe, torchrec and fbgemm cannot be imported
BLOCKER = """
import importlib.abc, json, sys
BLOCKED = {"recsys_pipe", "torchrec", "fbgemm_gpu"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked")
sys.meta_path.insert(0, Block())
"""
#: appended: the snippet's scores against the trained model's, another batch size, what it loaded
REPORT = """
got = program(*preprocess.inputs(rows).values())
expected = torch.load(f"{out}/expected_scores.pt")
if "candidates" in expected:
    table = torch.load(f"{out}/item_table.pt")
    got = (got[:, None, :] * table[expected["candidates"]]).sum(-1)
    known = set(preprocess.item_ids(range(len(table))).tolist())
    assert scores.shape == (len(rows), 10) and set(scores.flatten().tolist()) <= known
inputs = torch.load(f"{out}/example_inputs.pt")
half = {k: v[: max(1, len(v) // 2)] for k, v in inputs.items()}
program(*half.values())
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps({"diff": float((got - expected["scores"]).abs().max()), "loaded": loaded, "n": got.shape[0]}))
"""


def serving_snippet() -> str:
    """The ten lines docs/operations/serving.md shows (its only python block)."""
    page = (ROOT / "docs" / "operations" / "serving.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len([line for line in block.strip().splitlines() if line.strip()]) <= 10
    return block


def load_fresh(out: Path) -> dict:
    """Run the docs' snippet on `out` in a fresh interpreter (cwd: `out`'s parent)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = BLOCKER + serving_snippet().replace('out = "exported"', f"out = {out.name!r}") + REPORT
    proc = subprocess.run(  # any UserWarning (a requires_grad one, say) fails the snippet
        [sys.executable, "-W", "error::UserWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=out.parent,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
