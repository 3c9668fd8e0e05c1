"""Training adapter: the torchrec task functions, their shared state, and the training loop."""

from recsys_pipe.train.distributed import DistInfo, init_distributed, resolve_device, shared_run_dir, teardown
from recsys_pipe.train.params import local_parameters
from recsys_pipe.train.state import TrainState
from recsys_pipe.train.tasks import StepResult
from recsys_pipe.train.trainer import Trainer, TrainSummary, build_model, data_config

__all__ = [
    "DistInfo",
    "StepResult",
    "TrainState",
    "TrainSummary",
    "Trainer",
    "build_model",
    "data_config",
    "init_distributed",
    "local_parameters",
    "resolve_device",
    "shared_run_dir",
    "teardown",
]
