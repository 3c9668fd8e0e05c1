"""`recsys-export RUN_DIR OUT`: write a trained run's model as a program a serving process loads
without this package (`recsys_pipe.train.export`).

    recsys-export runs/recsys-train/2026-11-27_06-47-57 exported/
    recsys-export RUN_DIR OUT checkpoint=step_400            # another checkpoint than the newest
    recsys-export RUN_DIR OUT data.path=/data/heldout.tsv    # the run's config, with overrides
    recsys-export RUN_DIR OUT --overwrite                    # replace OUT whole

One process, no torchrun: the checkpoint's shards are gathered into whole tables on load.
Exit codes: 0 written; 2 a bad argument, run directory, checkpoint, override or OUT (a file, or
a directory that is not empty without --overwrite; one line each, nothing written); 1 the
export failed (the saved program or preprocess.py does not reproduce the trained model's scores;
OUT is left as it was).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from recsys_pipe.cli.console import show_library_warnings
from recsys_pipe.cli.reporting import report_config_error
from recsys_pipe.config import ConfigError, ConfigProblem
from recsys_pipe.runtime.failures import EXIT_CONFIG_ERROR, EXIT_FAILURE, one_line

__all__ = ["main", "parse_overrides", "run"]

PROG = "recsys-export"


def parse_overrides(items: Sequence[str]) -> tuple[str | None, dict[str, object]]:
    """`checkpoint=step_N` and `key=value` overrides (values as Hydra's grammar reads them)."""
    from recsys_pipe.cli.hydra_adapter import parse_override_value, quoted_home

    checkpoint, overrides = None, {}
    for item in items:
        key, sep, value = quoted_home(item).partition("=")
        if not sep or not key:
            raise ConfigError(ConfigProblem(item, "expected key=value (e.g. checkpoint=step_100, data.path=...)"))
        try:
            parsed = parse_override_value(value)
        except Exception as exc:  # Hydra's grammar error types vary; its message says what is wrong
            raise ConfigError(ConfigProblem(key, f"cannot parse {value!r}: {one_line(exc)}")) from None
        if key == "checkpoint":
            checkpoint = str(parsed)
        else:
            overrides[key] = parsed
    return checkpoint, overrides


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Export a trained run's model with torch.export: a scoring program (ranking models) or a "
        "user encoder plus its item table (retrieval models), with held-out example inputs and the "
        "trained model's scores of them.",
    )
    parser.add_argument("run_dir", help="the run directory (holds config.yaml and checkpoints/)")
    parser.add_argument("out", help="the directory to write program.pt2, example_inputs.pt, ... into")
    parser.add_argument(
        "overrides", nargs="*", help="checkpoint=step_N (default: the newest), key=value changes of the run's config"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT whole if it is not empty")
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    """Run `recsys-export` with `argv`; returns the exit code."""
    args = _parser().parse_args(argv)
    show_library_warnings(0, debug=False)
    try:
        from recsys_pipe.train.export import export_run

        checkpoint, overrides = parse_overrides(args.overrides)
        result = export_run(args.run_dir, args.out, checkpoint, overrides, overwrite=args.overwrite)
    except ConfigError as exc:
        report_config_error(exc, PROG, outcome="nothing was exported")
        return EXIT_CONFIG_ERROR
    except RuntimeError as exc:
        print(f"{PROG}: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    names = ", ".join(p.name for p in result.files)
    checked = f"checked: max |score diff| {result.max_abs_diff:.2g}"
    print(f"exported the {result.kind} model to {result.out}: {names} ({checked})")
    return 0


def main() -> None:
    """Console-script entry point."""
    sys.exit(run())


if __name__ == "__main__":
    main()
