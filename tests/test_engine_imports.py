"""The engine must stay importable without the training stack (SPEC §1)."""

import subprocess
import sys

FORBIDDEN = ("torchrec", "fbgemm_gpu", "megatron", "hydra", "pydantic", "omegaconf")


def test_engine_imports_no_training_stack():
    code = (
        "import sys, recsys_pipe.engine, recsys_pipe.engine.testing\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"engine imported: {out.stdout.strip()}"


def test_engine_sources_do_not_mention_forbidden_imports():
    import pathlib
    import re

    import recsys_pipe.engine as engine

    pattern = re.compile(r"^\s*(?:from|import)\s+(" + "|".join(FORBIDDEN) + r")\b", re.M)
    for path in pathlib.Path(engine.__file__).parent.glob("*.py"):
        assert not pattern.search(path.read_text()), f"{path.name} imports a forbidden package"
