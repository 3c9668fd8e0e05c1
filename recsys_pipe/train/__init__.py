"""Training adapter: the run config, the torchrec task functions, their shared state, the loop."""

from recsys_pipe.train.checkpoint import CheckpointConfig, Checkpointer, find_checkpoints, resolve_resume
from recsys_pipe.train.config import RunConfig, TrainerConfig, load_run_config
from recsys_pipe.train.distributed import DistInfo, init_distributed, resolve_device, teardown
from recsys_pipe.train.health import PeerFailure, PeerHealth
from recsys_pipe.train.metrics import MetricsWriter
from recsys_pipe.train.optim import LrSchedule, OptimizerConfig, SparseOptimizerConfig, TrainOptimizer
from recsys_pipe.train.params import local_parameters
from recsys_pipe.train.plan import training_plan
from recsys_pipe.train.preemption import StopRequest
from recsys_pipe.train.rng import RngState
from recsys_pipe.train.rundir import shared_run_dir
from recsys_pipe.train.state import TrainState
from recsys_pipe.train.status import RunStatus
from recsys_pipe.train.tasks import StepResult
from recsys_pipe.train.trainer import Trainer, TrainSummary, build_model, build_pipeline
from recsys_pipe.train.verify import CollectiveGuard, UndeclaredCollectiveError

__all__ = [
    "CheckpointConfig",
    "CollectiveGuard",
    "Checkpointer",
    "DistInfo",
    "LrSchedule",
    "MetricsWriter",
    "OptimizerConfig",
    "PeerFailure",
    "PeerHealth",
    "RngState",
    "RunConfig",
    "RunStatus",
    "SparseOptimizerConfig",
    "StepResult",
    "StopRequest",
    "TrainOptimizer",
    "TrainState",
    "TrainSummary",
    "Trainer",
    "TrainerConfig",
    "UndeclaredCollectiveError",
    "build_model",
    "build_pipeline",
    "find_checkpoints",
    "init_distributed",
    "load_run_config",
    "local_parameters",
    "resolve_device",
    "resolve_resume",
    "shared_run_dir",
    "teardown",
    "training_plan",
]
