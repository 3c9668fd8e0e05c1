"""Where a run's numbers go: `metrics.jsonl` (one JSON object per log step and per evaluation)
and TensorBoard event files, both in the run directory, written by rank 0 only.

A resumed run writes its TensorBoard events into the directory of the run it continues (the
first run's, through a chain of resumes: `<run_dir>/tensorboard_dir` names it), from the
checkpoint's step on (`MetricsWriter.continue_tensorboard`): one run, one curve, each step once.
`tensorboard --logdir <trainer.output_dir>` then shows every run side by side: `train/loss`,
`train/samples_per_s`, `train/lr`, `train/grad_norm` (with clipping), `eval/loss`, `eval/auc`
and `eval/auc_task<k>` (ranking), `eval/<split>/<protocol>/<metric>` (retrieval:
`eval/test/sampled/NDCG@10`), all against the global step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["TENSORBOARD_DIR_FILE", "MetricsWriter", "tensorboard_dir"]

#: in a resumed run's directory: the directory its TensorBoard events go to
TENSORBOARD_DIR_FILE = "tensorboard_dir"


def tensorboard_dir(run_dir: str | os.PathLike) -> str:
    """Where the TensorBoard events of the run in `run_dir` are: its own directory, or for a
    resumed run the one its `tensorboard_dir` file names."""
    pointer = os.path.join(run_dir, TENSORBOARD_DIR_FILE)
    if os.path.isfile(pointer):
        return Path(pointer).read_text().strip()
    return str(run_dir)


#: metrics.jsonl key -> TensorBoard tag of training records (evaluation records: see `write`)
_TRAIN_TAGS = {
    "loss": "train/loss",
    "samples_per_s": "train/samples_per_s",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
}


class MetricsWriter:
    """Appends records to `<run_dir>/metrics.jsonl` and mirrors them to TensorBoard.

    The files are opened with the first record: a command that builds a run's parts but
    trains nothing (`recsys-profile`) leaves no empty metrics behind.

    Args:
        run_dir: the run directory, or None to write nothing (ranks other than 0, tests).
        tensorboard: also write TensorBoard event files (`torch.utils.tensorboard`).
    """

    def __init__(self, run_dir: str | None, tensorboard: bool = True):
        self._run_dir, self._tensorboard = run_dir, tensorboard
        self._jsonl: Any = None
        self._tb: Any = None
        #: where the TensorBoard events go and the first step they hold (a resumed run:
        #: `continue_tensorboard`); by default this run's directory, from its first record
        self._tb_dir, self._purge_step = run_dir, None

    def _open(self) -> None:
        assert self._run_dir is not None
        self._jsonl = open(os.path.join(self._run_dir, "metrics.jsonl"), "a")  # noqa: SIM115 - closed by close()
        if self._tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=self._tb_dir, purge_step=self._purge_step)

    def write(self, record: dict[str, Any]) -> None:
        """One record with its `step`: training (`loss`, ...) or evaluation (`auc`, ...)."""
        if self._run_dir is None:
            return
        if self._jsonl is None:
            self._open()
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is None:
            return
        step = record["step"]
        if "valid" in record:  # retrieval: {split: {protocol: {metric: value}}}
            for split in ("valid", "test"):
                for protocol, values in record.get(split, {}).items():
                    for name, value in values.items():
                        self._tb.add_scalar(f"eval/{split}/{protocol}/{name}", value, step)
        elif "auc" in record:
            self._tb.add_scalar("eval/loss", record["eval_loss"], step)
            self._tb.add_scalar("eval/auc", record["auc"], step)
            for k, auc in enumerate(record.get("auc_per_task", [])):
                self._tb.add_scalar(f"eval/auc_task{k}", auc, step)
        else:
            for key, tag in _TRAIN_TAGS.items():
                if record.get(key) is not None:
                    self._tb.add_scalar(tag, record[key], step)
        self._tb.flush()

    def continue_tensorboard(self, resumed_run_dir: str | os.PathLike, step: int) -> None:
        """Resuming at `step` a run of `resumed_run_dir`: write the TensorBoard events into that
        run's event directory from step `step + 1` on, and note it in this run's directory.

        `purge_step` (TensorBoard's own mechanism for a restart) marks the restart in the event
        file, and TensorBoard then drops the events of steps >= `step + 1` written before it:
        the steps the earlier run trained after its checkpoint, which this run trains again."""
        if self._run_dir is None or not self._tensorboard:
            return
        self.close()  # the next record opens the writer in the continued directory
        self._tb_dir, self._purge_step = tensorboard_dir(resumed_run_dir), step + 1
        with open(os.path.join(self._run_dir, TENSORBOARD_DIR_FILE), "w") as f:
            f.write(self._tb_dir + "\n")

    def close(self) -> None:
        """Flush and close `metrics.jsonl` and the TensorBoard writer; safe to call twice (a
        record written after it opens them again, appending)."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
