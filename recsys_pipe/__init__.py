"""recsys_pipe: a declarative, YAML-configured training launcher for torchrec models."""

__version__ = "0.1.0"
