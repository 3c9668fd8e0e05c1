"""Export a trained run for serving (`recsys-export RUN_DIR OUT`): the model of one checkpoint,
gathered from its shards, traced by `torch.export` into a program that loads without this
package (nor torchrec), with held-out inputs, the scores the trained model gives them, and what
turns raw rows into those inputs.

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
* `features.json`, `preprocess.py`: every input's transform, from the run's data config, and
  the numpy/torch code that applies it to raw rows (`recsys_pipe.data.preprocess`, copied);
* `raw_example.jsonl`: the samples of `example_inputs.pt`, one raw row per line;
* `serving.json`: what the program takes and returns, and where it came from.

Before it reports success, the export checks the saved files in a fresh interpreter where
neither this package, torchrec nor fbgemm can be imported (`serving_check.py`): the program
scores `example_inputs.pt` as `expected_scores.pt` says, and `preprocess.py` makes the same
inputs from `raw_example.jsonl`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.data import FEATURES_FORMAT, ServedSource, preprocess_file, served_source
from recsys_pipe.models.serving import Servable, ServingForm
from recsys_pipe.train.checkpoint import find_checkpoints, read_metadata, saved_config
from recsys_pipe.train.config import RunConfig, load_run_config
from recsys_pipe.train.parallel import parallelism_of

__all__ = [
    "EXPORT_TOLERANCE",
    "ExportDir",
    "ExportResult",
    "TrainedModel",
    "export_run",
    "features_json",
    "load_run",
    "load_trained_model",
    "resolve_checkpoint",
    "verify_exports",
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
    if not run_dir.is_dir():
        what = "no such directory" if not run_dir.exists() else "not a directory"
        raise ConfigError(ConfigProblem("run_dir", f"{run_dir}: {what}"))
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

    run_dir = Path(os.path.expanduser(str(run_dir)))
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
    """What `export_run` wrote, and how closely the saved program reproduces the trained model."""

    out: Path
    files: list[Path]
    #: the largest score difference the check in a fresh interpreter found (None: not checked)
    max_abs_diff: float | None
    kind: str


@dataclass
class HeldOut:
    """The first held-out batch of a run's data, where it comes from and its rows raw."""

    batch: Any
    #: the evaluation split it is of (a retrieval source's `valid`), else `eval`
    split: str
    source: ServedSource


def _held_out(run: RunConfig) -> HeldOut:
    """The first held-out batch of the run's data (the first evaluation batch: a retrieval
    source's validation users, a ranking source's evaluation tail), else its first batch."""
    from recsys_pipe.data import RankData
    from recsys_pipe.train.retrieval_eval import RetrievalEvaluation

    data = RankData(run.data, 0, 1, eval_batches=max(run.trainer.eval_batches, 1))
    source = served_source(data.dataset)
    retrieval = RetrievalEvaluation.of(data, 1, None, True)
    if retrieval is not None:
        split, loader = next(iter(retrieval.loaders.items()))
    else:
        split, loader = "eval", data.eval_loader()
    return HeldOut(next(iter(loader)), split, source)


def export_run(
    run_dir: str | Path,
    out: str | Path,
    checkpoint: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    verify: bool = True,
) -> ExportResult:
    """Export the model of `run_dir`'s checkpoint into `out` (see the module docstring).

    `out` must be new or empty unless `overwrite` (ConfigError at `OUT` before anything is read);
    the files are written into a hidden directory beside it and take its place only once
    verified (`verify_exports`, skipped with `verify=False`: a caller that verifies many exports
    in one interpreter), so a failed export leaves `out` as it was."""
    target = ExportDir.claim(Path(out), overwrite)
    trained = load_trained_model(run_dir, checkpoint, overrides)
    module = trained.module
    if not isinstance(module, Servable):
        raise ConfigError(
            ConfigProblem("model.name", f"model '{trained.run.model.label}' has no serving program to export")
        )
    form = module.serving(trained.run.data)
    held = _held_out(trained.run)
    if form.item_remap is not None:  # a managed item table: the catalogue's raw ids are scored
        form = form.over_catalogue(torch.as_tensor(held.source.catalogue))  # type: ignore[attr-defined]
    example = _example(module, form, held)
    program = _export(form, example.inputs)
    staging = target.staging()
    try:
        files = _write(staging, form, held, example, program)
        diff = None
        if verify:
            (record,) = verify_exports([staging])
            diff = _checked(record)
        files.append(staging / "serving.json")
        files[-1].write_text(json.dumps(_description(trained, form, example, diff), indent=2) + "\n")
        target.publish(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(target.path, [target.path / f.name for f in files], diff, _kind(form))


@dataclass
class _Example:
    """The held-out samples (padding left out) in the program's inputs and the trained scores."""

    inputs: tuple[torch.Tensor, ...]
    expected: dict[str, torch.Tensor]
    sample_ids: list[int]


def _example(module: nn.Module, form: ServingForm, held: HeldOut) -> _Example:
    batch = held.batch
    with torch.no_grad():
        _, outputs = module(batch)
        expected = {"scores": form.reference(batch, outputs).detach().clone()}
        if form.candidates is not None:
            expected["candidates"] = form.candidates(batch).detach().clone()
        inputs = tuple(t.detach().clone() for t in form.inputs(batch))
    keep = batch.sample_ids >= 0  # an evaluation batch's padding (sample id -1) is not a sample
    return _Example(
        tuple(t[keep] for t in inputs),
        {k: v[keep] for k, v in expected.items()},
        batch.sample_ids[keep].tolist(),
    )


def _kind(form: ServingForm) -> str:
    return "retrieval" if form.retrieval else "ranking"


def _write(
    staging: Path,
    form: ServingForm,
    held: HeldOut,
    example: _Example,
    program: torch.export.ExportedProgram,
) -> list[Path]:
    """The files of the export but `serving.json`, into `staging`; returns them."""
    files = [staging / name for name in ("program.pt2", "example_inputs.pt", "expected_scores.pt")]
    torch.export.save(program, str(files[0]))
    torch.save(dict(zip(form.input_names, example.inputs)), files[1])
    torch.save(example.expected, files[2])
    if form.item_table is not None:
        files.append(staging / "item_table.pt")
        torch.save(form.item_table.detach().clone(), files[-1])
    features = features_json(form, held.source.serving_features())
    files.append(staging / "features.json")
    files[-1].write_text(json.dumps(features, indent=1) + "\n")
    files.append(staging / "preprocess.py")
    shutil.copyfile(preprocess_file(), files[-1])
    rows = held.source.raw_rows(example.sample_ids, held.split)
    files.append(staging / "raw_example.jsonl")
    files[-1].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return files


def features_json(form: ServingForm, described: Mapping[str, Any]) -> dict[str, Any]:
    """`features.json`: the program's inputs, each with the data's features in its columns (the
    model's `slots`, else the data's own order), and those features' records."""
    data_slots = described.get("inputs", {})
    inputs = {name: list(form.slots.get(name, data_slots.get(name, ()))) for name in form.input_names}
    used = {feature for names in inputs.values() for feature in names}
    records = described["features"]
    missing = sorted(used - set(records))
    if missing:
        raise RuntimeError(f"the data source describes no feature {missing[0]!r} that the program takes")
    return {
        "format": FEATURES_FORMAT,
        "program": form.program,
        "inputs": inputs,
        "features": {name: records[name] for name in records if name in used},
        "params": {**described.get("params", {}), **form.params},
    }


def verify_exports(outs: Sequence[Path]) -> list[dict[str, Any]]:
    """Score the saved files of each export in one fresh interpreter where recsys_pipe, torchrec
    and fbgemm cannot be imported (`recsys_pipe.train.serving_check`); one record per export."""
    script = Path(__file__).with_name("serving_check.py")
    # -B: importing the export's preprocess.py must not leave a __pycache__ folder in OUT
    proc = subprocess.run(
        [sys.executable, "-I", "-B", str(script), *map(str, outs)], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise RuntimeError(
            f"the saved export does not load and score in a fresh interpreter: {lines[-1] if lines else ''}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _checked(record: Mapping[str, Any]) -> float:
    """The largest score difference of a verified export; RuntimeError (exit 1) past the tolerance."""
    if record["program_diff"] > EXPORT_TOLERANCE:
        raise RuntimeError(
            f"the saved program's scores differ from the trained model's by {record['program_diff']:.3g}"
        )
    if not record["inputs_match"]:
        raise RuntimeError(
            f"preprocess.py makes input {record['mismatch']!r} of raw_example.jsonl other than example_inputs.pt's"
        )
    if record["raw_diff"] > EXPORT_TOLERANCE:
        raise RuntimeError(
            f"the scores of raw_example.jsonl differ from the trained model's by {record['raw_diff']:.3g}"
        )
    return max(record["program_diff"], record["raw_diff"])


@dataclass(frozen=True)
class ExportDir:
    """The output directory of an export: claimed before anything is read, written beside it,
    and replaced whole once the export is complete."""

    path: Path
    overwrite: bool

    @classmethod
    def claim(cls, path: Path, overwrite: bool) -> ExportDir:
        """ConfigError at `OUT` for a file, or for a directory that holds anything (unless `overwrite`)."""
        path = Path(os.path.expanduser(str(path)))
        if path.exists() and not path.is_dir():
            raise ConfigError(ConfigProblem("OUT", f"{path} is a file, not a directory"))
        if path.is_dir() and any(path.iterdir()) and not overwrite:
            raise ConfigError(
                ConfigProblem("OUT", f"{path} is not empty (--overwrite replaces it whole: nothing of it is kept)")
            )
        return cls(path, overwrite)

    def staging(self) -> Path:
        """A new hidden directory beside the output (its parents made), for the files being written."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", suffix=".partial", dir=self.path.parent))

    def publish(self, staging: Path) -> None:
        """Put `staging` in the output's place (what was there, with `overwrite`, is removed)."""
        old = None
        if self.path.exists():
            old = self.path.with_name(f".{self.path.name}.{os.getpid()}.old")
            self.path.rename(old)
        staging.rename(self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _export(form: ServingForm, inputs: tuple[torch.Tensor, ...]) -> torch.export.ExportedProgram:
    """`torch.export` of the form's module; any batch size (and any list length of its `ragged`
    inputs) where the form says so."""
    dynamic = None
    if form.dynamic_batch:
        batch = torch.export.Dim("batch", min=1)
        dynamic = tuple(
            {0: batch, t.dim() - 1: torch.export.Dim(f"{name}_length", min=1)} if name in form.ragged else {0: batch}
            for name, t in zip(form.input_names, inputs)
        )
    # weights that need no gradient: the loaded program's scores then need none either, so serving
    # builds no autograd graph (and `float(scores...)` does not warn about requires_grad)
    form.module.requires_grad_(False)
    with torch.no_grad():
        return torch.export.export(form.module, inputs, dynamic_shapes=dynamic)


def _description(trained: TrainedModel, form: ServingForm, example: _Example, diff: float | None) -> dict[str, Any]:
    kind = _kind(form)
    return {
        "kind": kind,
        "model": trained.run.model.label,
        "checkpoint": str(trained.checkpoint),
        "step": trained.step,
        "inputs": {
            n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for n, t in zip(form.input_names, example.inputs)
        },
        "output": form.output
        or ("logits [B, num_tasks]" if kind == "ranking" else "user vectors [B, D]; score = user @ item_table[item]"),
        "dynamic_batch": form.dynamic_batch,
        "features": "features.json (preprocess.py turns raw rows into the inputs: raw_example.jsonl)",
        "max_abs_diff": diff,
    }
