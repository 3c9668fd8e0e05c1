"""A torch.profiler trace of a window of training steps (`trainer.torch_profiler.steps=[a,b]`).

The training loop calls `StepWindow.step(n)` once before its first step (n=0) and after every
step (n = steps completed), and `close()` at the end. The profiler starts after step a-1 and
stops after step b; each rank writes `<run dir>/torch_trace/rank<r>.json` (Chrome trace format,
as `torch.profiler.profile.export_chrome_trace` writes it; open it in https://ui.perfetto.dev),
with torch's `ProfilerStep#<n>` range around each training step n, and
`<run dir>/torch_trace/rank<r>_ops.txt`: torch's operator table (`key_averages().table`) of the
window, the operators that cost most first (by self device time where CUDA was traced, else by
self CPU time), so where a step's time goes can be read without opening the trace.
While it records, the plan runner's observer is a `RecordFunctionRanges`, so every task shows as a
`record_function` range named after it on the thread that ran it (every thread is profiled).
Outside the window nothing is installed and nothing is paid.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from recsys_pipe.engine import PlanRunner, RecordFunctionRanges

__all__ = ["StepWindow"]

log = logging.getLogger(__name__)


class StepWindow:
    """Starts and stops a torch profiler around training steps `[first, last]` (1-based).

    Args:
        steps: `[first, last]`, or None (then every call does nothing).
        out_dir: the run directory; the trace goes to `<out_dir>/torch_trace/rank<rank>.json`.
        rank: this process's rank.
        runner: the training plan runner, whose observer is swapped for the window.
    """

    def __init__(self, steps: list[int] | None, out_dir: str, rank: int, runner: PlanRunner):
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.path = os.path.join(out_dir, "torch_trace", f"rank{rank}.json")
        self.ops_path = os.path.join(out_dir, "torch_trace", f"rank{rank}_ops.txt")
        self.runner = runner
        self._profiler: Any = None
        self._previous_observer = None

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def step(self, completed: int) -> None:
        """Call with the number of training steps completed: 0 before the first one."""
        if self._profiler is None:
            if completed == self.first - 1:
                self._start()
            return
        if completed >= self.last:
            self._stop()  # also ends the last step's range
        else:
            self._profiler.step()  # ends step n's ProfilerStep#<n> range, opens the next one

    def close(self) -> None:
        """Stop and write the trace if the window is still open (the data ended inside it)."""
        if self._profiler is not None:
            self._stop()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            # a profiler schedule, even one that always records, is what makes torch mark the steps
            schedule=lambda step: torch.profiler.ProfilerAction.RECORD,
            # the executor's worker threads too, not only the thread that starts the profiler
            experimental_config=torch.profiler._ExperimentalConfig(profile_all_threads=True),
        )
        self._profiler.step_num = self.first  # step markers named after training steps: ProfilerStep#<n>
        self._profiler.__enter__()
        self._previous_observer = self.runner.observer
        self.runner.observer = RecordFunctionRanges()

    def _stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        self.runner.observer = self._previous_observer
        profiler.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        profiler.export_chrome_trace(self.path)
        with open(self.ops_path, "w") as f:
            f.write(operator_table(profiler) + "\n")
        log.info(
            "torch.profiler trace of steps %d..%d: %s (operators: %s)", self.first, self.last, self.path, self.ops_path
        )


#: rows of the operator table
OPS_ROWS = 40


def operator_table(profiler: Any) -> str:
    """torch's operator table of a finished profile, the costliest operators first: by self device
    time where the profile traced CUDA (what bounds a GPU step), else by self CPU time."""
    cuda = torch.profiler.ProfilerActivity.CUDA in profiler.activities
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return profiler.key_averages().table(sort_by=key, row_limit=OPS_ROWS, max_name_column_width=90)
