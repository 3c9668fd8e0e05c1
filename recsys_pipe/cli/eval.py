"""`recsys-eval RUN_DIR`: evaluate a trained run's checkpoint again (`recsys_pipe.train.evaluate_run`).

    recsys-eval runs/recsys-train/2026-11-27_06-47-57
    recsys-eval RUN_DIR checkpoint=step_400 data.path=/data/other.txt
    torchrun --nproc_per_node 2 --no-python recsys-eval RUN_DIR

Prints the training run's evaluation line (`eval at step N: loss ..., auc ...`, or the retrieval
protocols' HR@10 and NDCG@10) and writes `RUN_DIR/eval.json`. Exit codes: 0 evaluated; 2 a bad
run directory, checkpoint or override (one line each); 1 a failure while evaluating.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from recsys_pipe.cli.console import show_library_warnings
from recsys_pipe.cli.export import parse_overrides
from recsys_pipe.cli.reporting import report_config_error
from recsys_pipe.config import ConfigError
from recsys_pipe.runtime.failures import EXIT_CONFIG_ERROR, EXIT_FAILURE, config_error_in, one_line

__all__ = ["main", "run"]

PROG = "recsys-eval"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Evaluate a trained run's checkpoint with the run's saved config: AUC and log loss for "
        "ranking models, HR/NDCG/MRR on both protocols for retrieval models; writes RUN_DIR/eval.json.",
    )
    parser.add_argument("run_dir", help="the run directory (holds config.yaml and checkpoints/)")
    parser.add_argument(
        "overrides", nargs="*", help="checkpoint=step_N (default: the newest), key=value changes of the run's config"
    )
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    """Run `recsys-eval` with `argv`; returns the exit code."""
    args = _parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    show_library_warnings(rank, debug=False)
    logger = logging.getLogger("recsys_pipe")
    saved = logger.level, logger.propagate
    console = logging.StreamHandler(sys.stderr)
    if rank == 0:  # the training run's evaluation line, as its log shows it
        console.setFormatter(logging.Formatter("[%(asctime)s][rank 0][%(levelname)s] %(message)s", "%H:%M:%S"))
        logger.addHandler(console)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # a library's basicConfig would print every line twice
    try:
        from recsys_pipe.train.evaluate_run import evaluate_run

        checkpoint, overrides = parse_overrides(args.overrides)
        evaluate_run(args.run_dir, checkpoint, overrides)
    except Exception as exc:
        bad_input = config_error_in(exc)
        if isinstance(exc, ConfigError) or bad_input is not None:
            report_config_error(bad_input or exc, PROG, outcome="nothing was evaluated")
            return EXIT_CONFIG_ERROR
        print(f"{PROG}: rank {os.environ.get('RANK', '0')} failed: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    finally:  # a caller of `run` (a test) keeps its logging as it was
        logger.removeHandler(console)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
    return 0


def main() -> None:
    """Console-script entry point."""
    code = run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo's threads can abort an orderly interpreter shutdown (see recsys-train)


if __name__ == "__main__":
    main()
