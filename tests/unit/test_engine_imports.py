"""Layering: the engine and the task graph tooling stay importable without the training stack."""

import subprocess
import sys

FORBIDDEN = ("torchrec", "fbgemm_gpu", "megatron", "hydra", "pydantic", "omegaconf")


def test_engine_imports_no_training_stack():
    code = (
        "import sys, recsys_pipe.engine, recsys_pipe.engine.testing, recsys_pipe.autosched\n"
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
    root = pathlib.Path(engine.__file__).parent.parent
    for path in [*root.joinpath("engine").glob("*.py"), *root.joinpath("autosched").glob("*.py")]:
        assert not pattern.search(path.read_text()), f"{path.name} imports a forbidden package"


def test_runtime_is_below_the_training_loop():
    """`recsys_pipe.runtime` (process plumbing) is used by `recsys_pipe.train`, never the reverse,
    and needs neither the training stack nor the CLI's Hydra."""
    code = (
        "import sys, recsys_pipe.runtime as r\n"
        "for name in r.__all__: getattr(r, name)\n"
        "above = ('recsys_pipe.train', 'recsys_pipe.cli', 'recsys_pipe.models', 'recsys_pipe.data')\n"
        "stack = ('torchrec', 'fbgemm_gpu', 'hydra', 'megatron')\n"
        "bad = sorted(m for m in sys.modules if m.startswith(above) or m.split('.')[0] in stack)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"runtime imported: {out.stdout.strip()}"
