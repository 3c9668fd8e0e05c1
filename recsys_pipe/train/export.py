"""Export a trained run for serving (`recsys-export RUN_DIR OUT`): the model of one checkpoint,
gathered from its shards, traced by `torch.export` into a program that loads without this
package (nor torchrec), with held-out inputs and the scores the trained model gives them.

The checkpoint is read in one process: the model is built unsharded from the run's saved
config and DCP reads every table's shards into its full tensors (DCP reshards on load, so the
world size that wrote the checkpoint does not matter). Each model says how it scores from plain
tensors (`recsys_pipe.models.serving.Servable`); its serving module shares the loaded weights.

OUT holds:

* `program.pt2`: `torch.export.save` of the serving program (`torch.export.load(...).module()`);
* `item_table.pt` (retrieval models): `[num_items, D]`, the vectors user vectors score;
* `example_inputs.pt`: `{input name: tensor}` of one held-out batch, in the program's order;
* `expected_scores.pt`: `{"scores": ...}` the trained model's scores of those inputs (its own
  forward on the batch) and, for retrieval, `"candidates"`: the `[B, C]` items they score;
* `serving.json`: what the program takes and returns, and where it came from.

The export checks the program against `expected_scores` before it reports success.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.models.serving import Servable, ServingForm
from recsys_pipe.train.checkpoint import find_checkpoints, read_metadata, saved_config
from recsys_pipe.train.config import RunConfig, load_run_config
from recsys_pipe.train.parallel import parallelism_of

__all__ = [
    "EXPORT_TOLERANCE",
    "ExportResult",
    "TrainedModel",
    "export_run",
    "load_run",
    "load_trained_model",
    "resolve_checkpoint",
]

log = logging.getLogger(__name__)

#: largest difference allowed between the program's scores and the trained model's
EXPORT_TOLERANCE = 1e-5
#: DCP key prefix of the model's weights in a checkpoint (`recsys_pipe.train.trainer`)
_MODEL_KEY = "train.model."


@dataclass
class TrainedModel:
    """A run's model at one checkpoint, unsharded, in eval mode on the CPU."""

    run: RunConfig
    module: nn.Module
    checkpoint: Path
    step: int


def resolve_checkpoint(run_dir: Path, name: str | None) -> Path:
    """The run's newest complete checkpoint, or the one `name`d (`step_N`); ConfigError at
    `checkpoint` otherwise."""
    found = find_checkpoints(run_dir)
    if not found:
        raise ConfigError(ConfigProblem("run_dir", f"{run_dir} holds no complete checkpoint (checkpoints/step_<N>/)"))
    if name is None:
        return found[-1].path
    for info in found:
        if info.path.name == name:
            return info.path
    names = ", ".join(info.path.name for info in found)
    raise ConfigError(ConfigProblem("checkpoint", f"{run_dir} has no checkpoint '{name}' (it has {names})"))


def load_run(run_dir: Path, checkpoint: Path, overrides: Mapping[str, Any]) -> RunConfig:
    """The run's saved config (`config.yaml`) with `overrides` (dotted key -> value) applied,
    validated as a run config (unknown keys and bad values are ConfigErrors at their paths)."""
    saved = saved_config(checkpoint)
    if saved is None:
        raise ConfigError(ConfigProblem("run_dir", f"{run_dir} has no readable config.yaml"))
    cfg = OmegaConf.create(saved)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=True, force_add=True)
    return load_run_config(cfg)


def load_trained_model(
    run_dir: str | Path, checkpoint: str | None = None, overrides: Mapping[str, Any] | None = None
) -> TrainedModel:
    """The model of `run_dir`'s checkpoint (`checkpoint`: `step_N`, default the newest), built
    unsharded from the run's config and loaded with every table gathered from its shards."""
    import torch.distributed.checkpoint as dcp

    run_dir = Path(run_dir)
    path = resolve_checkpoint(run_dir, checkpoint)
    run = load_run(run_dir, path, overrides or {})
    parallelism_of(run).check_export()
    torch.manual_seed(run.seed)
    module = run.model.build(run.data.spec())
    saved = read_metadata(path).state_dict_metadata
    ddp = any(k.startswith(_MODEL_KEY + "module.") for k in saved)  # a plain model trained under DDP
    prefix = _MODEL_KEY + ("module." if ddp else "")
    state = {prefix + k: v for k, v in module.state_dict().items()}
    missing = [k for k in state if k not in saved]
    if missing:
        raise ConfigError(ConfigProblem("checkpoint", f"{path} does not hold this model's {missing[0][len(prefix) :]}"))
    with warnings.catch_warnings():  # DCP warns that it reads in one process, which is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    module.load_state_dict({k[len(prefix) :]: v for k, v in state.items()})
    module.eval()
    step = int(path.name.split("_", 1)[1])
    return TrainedModel(run, module, path, step)


@dataclass
class ExportResult:
    """What `export_run` wrote, and how closely the program reproduces the trained model."""

    out: Path
    files: list[Path]
    max_abs_diff: float
    kind: str


def _held_out_batch(run: RunConfig) -> Any:
    """The first held-out batch of the run's data (the first evaluation batch: a retrieval
    source's validation users, a ranking source's evaluation tail), else its first batch."""
    from recsys_pipe.data import RankData
    from recsys_pipe.train.retrieval_eval import RetrievalEvaluation

    data = RankData(run.data, 0, 1, eval_batches=max(run.trainer.eval_batches, 1))
    retrieval = RetrievalEvaluation.of(data, 1, None, True)
    loader = next(iter(retrieval.loaders.values())) if retrieval is not None else data.eval_loader()
    return next(iter(loader))


def export_run(
    run_dir: str | Path, out: str | Path, checkpoint: str | None = None, overrides: Mapping[str, Any] | None = None
) -> ExportResult:
    """Export the model of `run_dir`'s checkpoint into `out` (see the module docstring)."""
    trained = load_trained_model(run_dir, checkpoint, overrides)
    module = trained.module
    if not isinstance(module, Servable):
        raise ConfigError(
            ConfigProblem("model.name", f"model '{trained.run.model.label}' has no serving program to export")
        )
    form = module.serving()
    batch = _held_out_batch(trained.run)
    with torch.no_grad():
        _, outputs = module(batch)
        expected = form.reference(batch, outputs).detach().clone()
        inputs = tuple(t.detach().clone() for t in form.inputs(batch))
    program = _export(form, inputs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "program.pt2", out / "example_inputs.pt", out / "expected_scores.pt", out / "serving.json"]
    torch.export.save(program, str(files[0]))
    torch.save(dict(zip(form.input_names, inputs)), files[1])
    expected_file: dict[str, torch.Tensor] = {"scores": expected}
    if form.retrieval:
        assert form.item_table is not None and form.candidates is not None
        expected_file["candidates"] = form.candidates(batch).detach().clone()
        files.append(out / "item_table.pt")
        torch.save(form.item_table.detach().clone(), files[-1])
    torch.save(expected_file, files[2])
    diff = _max_diff(program.module(), form, inputs, expected_file)
    kind = "retrieval" if form.retrieval else "ranking"
    files[3].write_text(json.dumps(_description(trained, form, kind, inputs, expected, diff), indent=2) + "\n")
    if diff > EXPORT_TOLERANCE:
        raise RuntimeError(f"the exported program's scores differ from the trained model's by {diff:.3g}")
    return ExportResult(out, files, diff, kind)


def _export(form: ServingForm, inputs: tuple[torch.Tensor, ...]) -> torch.export.ExportedProgram:
    dynamic = None
    if form.dynamic_batch:
        batch = torch.export.Dim("batch", min=1)
        dynamic = tuple({0: batch} for _ in inputs)
    with torch.no_grad():
        return torch.export.export(form.module, inputs, dynamic_shapes=dynamic)


def score(
    program: nn.Module, inputs: tuple[torch.Tensor, ...], expected: dict[str, torch.Tensor], table: Any
) -> torch.Tensor:
    """The program's scores in `expected_scores`' layout (retrieval: the candidates' dot products)."""
    out = program(*inputs)
    if table is None:
        return out
    return torch.einsum("bd,bcd->bc", out, table[expected["candidates"]])


def _max_diff(program: nn.Module, form: ServingForm, inputs: tuple[torch.Tensor, ...], expected: dict) -> float:
    with torch.no_grad():
        got = score(program, inputs, expected, form.item_table)
    return float((got - expected["scores"]).abs().max()) if got.numel() else 0.0


def _description(
    trained: TrainedModel,
    form: ServingForm,
    kind: str,
    inputs: tuple[torch.Tensor, ...],
    expected: torch.Tensor,
    diff: float,
) -> dict[str, Any]:
    return {
        "kind": kind,
        "model": trained.run.model.label,
        "checkpoint": str(trained.checkpoint),
        "step": trained.step,
        "inputs": {
            n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for n, t in zip(form.input_names, inputs)
        },
        "output": form.output
        or ("logits [B, num_tasks]" if kind == "ranking" else "user vectors [B, D]; score = user @ item_table[item]"),
        "dynamic_batch": form.dynamic_batch,
        "max_abs_diff": diff,
    }
