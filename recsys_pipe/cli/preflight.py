"""Checks of the machine a run needs, shared by the CLIs that start a process group.

Why here and not in the config schema: whether CUDA is visible is a fact about this machine,
not about the config, but it is still the user's input that is wrong (`trainer.device=cuda` or
`trainer.backend=nccl` on a machine without a GPU), so it is a ConfigError (exit 2, one line)
found before any process group starts, never a traceback from inside `init_process_group`.
"""

from __future__ import annotations

from typing import Any

from recsys_pipe.config import ConfigError, ConfigProblem

__all__ = ["run_device"]


def run_device(trainer: Any) -> Any:
    """The `torch.device` this rank trains on (`trainer.device`), checked against
    `trainer.backend`: NCCL needs CUDA tensors."""
    from recsys_pipe.runtime import resolve_device

    try:
        device = resolve_device(trainer.device)
    except RuntimeError as exc:
        raise ConfigError(ConfigProblem("trainer.device", str(exc))) from None
    if trainer.backend == "nccl" and device.type != "cuda":
        where = "no CUDA device is visible" if trainer.device == "auto" else f"trainer.device={trainer.device}"
        raise ConfigError(
            ConfigProblem("trainer.backend", f"nccl needs CUDA and {where}; use trainer.backend=gloo (or auto)")
        )
    return device
