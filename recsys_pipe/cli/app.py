"""The Hydra app every console script runs (`recsys-plan`, `recsys-train`, `recsys-profile`).

Why a wrapper around `@hydra.main`: we keep Hydra's real entry point (so `--help`, `--cfg job`,
`-m` sweeps, `+`/`~` overrides and run dirs all behave as Hydra users expect) but fix its exit
codes: any config problem -- a bad override, an unknown group option, a typo'd key, an invalid
plan -- exits with code 2 and readable `error: <path>: <message>` lines, never a traceback
(unless `HYDRA_FULL_ERROR=1` or `debug=true`). Hydra itself exits 1 for everything. `--help`
ends with every key, its current value and its description (`recsys_pipe.cli.keys`).

Usage from a CLI module:

    def task(cfg: DictConfig) -> None: ...          # may raise ConfigError
    app = HydraApp(task, config_name="plan", prog="recsys-plan", schema="pkg.module:Config")
    # app.main() -> SystemExit(code); app.run(argv) -> code (in-process, for tests)
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from recsys_pipe import _ctrl_c
from recsys_pipe.cli.compose import compose_config
from recsys_pipe.cli.hydra_adapter import (
    HYDRA_MODE_UNKNOWN,
    checked_job,
    clear_global_hydra,
    composed_job,
    hydra_main,
    hydra_runtime,
    parse_hydra_args,
    quoted_home,
    sweep_jobs,
)
from recsys_pipe.cli.reporting import debug_requested, first_to_report, report_config_error
from recsys_pipe.cli.schemas import register_schemas
from recsys_pipe.cli.sweeps import SweepLog
from recsys_pipe.config import CONF_DIR, ConfigError, ConfigProblem, UserCodeError
from recsys_pipe.runtime.failures import (  # the exit codes, re-exported for the CLIs
    EXIT_CONFIG_ERROR,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
)

__all__ = [
    "CHECK_ONLY",
    "EXIT_CONFIG_ERROR",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "KEEP_GOING",
    "HydraApp",
]

#: Command-line flag of a sweep (`-m`): run the valid jobs even if some are invalid; each invalid
#: one is recorded as failed (exit code 2) in its job directory, and the sweep exits 2.
KEEP_GOING = "--keep-going"
#: Command-line flag: check every job's config and inputs as a run would before it starts any
#: process group (`check`), print the problems, exit 0 or 2; nothing runs (scripts/train.sh uses
#: it so that config errors never go through torchrun).
CHECK_ONLY = "--check"


class HydraApp:
    """A Hydra app whose failures map to exit codes: 0 ok, 2 config error, 1 runtime error.

    Before Hydra runs anything, the config of every job is composed here (one job, or each job
    of a `-m` sweep, checked with `validate` too), so that a bad key, YAML file, group option or
    value is reported in one line per problem (see `compose_errors`) and a sweep with a bad job
    starts none (with `--keep-going`, the others run and the bad one is recorded as failed).

    Args:
        task: `task(cfg)`; raises ConfigError for bad input, SystemExit(code) to choose a code.
        config_name: the primary config in the packaged conf/ tree.
        prog: the command's name in messages.
        schema: "module:Class" of the validated config, for `--help`'s key listing and the
            suggestions for a misspelled key.
        validate: `validate(cfg)` raises ConfigError for a config `task` would refuse (checked for
            every job, of a sweep too, before the first starts and before Hydra creates a directory).
        check: with `--check`, what is run instead of `validate` (and of the task): every check
            the task makes before it starts anything (its data, output dir, device...).
        sweep_check: what is run instead of `validate` for each job of a `-m` sweep, before the
            first job starts: the checks each job would make, but its run directory.
    """

    def __init__(
        self,
        task: Callable[[DictConfig], Any],
        config_name: str,
        prog: str,
        schema: str | None = None,
        validate: Callable[[DictConfig], Any] | None = None,
        check: Callable[[DictConfig], Any] | None = None,
        sweep_check: Callable[[DictConfig], Any] | None = None,
    ):
        self.task = task
        self.check = check
        self.sweep_check = sweep_check or validate
        self._multirun = False
        self.config_name = config_name
        self.prog = prog
        self.schema = schema
        self.validate = validate
        self._started = False
        self._keep_going = False
        self._check_only = False
        self._failed_jobs: list[str] = []
        self._jobs_done = 0
        self._jobs_checked = 0
        self._sweep = SweepLog()

    def _task(self, cfg: DictConfig) -> Any:
        self._started = True
        try:
            result = self.task(cfg)
            self._jobs_done += 1
            self._sweep.record(_sweep_job(), EXIT_OK)
            return result
        except SystemExit as exc:  # the job's own exit code (1, 75, 130...), for the sweep's summary
            self._sweep.record(_sweep_job(), exc.code if isinstance(exc.code, int) else EXIT_FAILURE)
            raise
        except BrokenPipeError:  # `recsys-plan | head`: the reader left; not an error
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            raise SystemExit(0) from None
        except UserCodeError as exc:  # the user's builder raised: its key and their frames, not Hydra's report
            self._sweep.record(_sweep_job(), EXIT_FAILURE)
            _report_user_code(exc, cfg)
            raise SystemExit(EXIT_FAILURE) from None
        except ConfigError as exc:
            if debug_requested(cfg):
                traceback.print_exc()
            job = _sweep_job()
            self._sweep.record(job, EXIT_CONFIG_ERROR)
            if job is not None:  # its directory (made by Hydra) says why it did not run
                self._record_failed_job(job, exc, announce=self._keep_going)
                if self._keep_going:
                    return None
            outcome = None
            if job is not None and self._jobs_done:
                outcome = f"sweep job {job[0]} did not start ({self._jobs_done} earlier job(s) ran)"
            report_config_error(exc, self.prog, outcome=outcome)
            sys.stdout.flush()
            raise SystemExit(EXIT_CONFIG_ERROR) from None

    def _record_failed_job(self, job: tuple[int, list[str], str], exc: ConfigError, announce: bool) -> None:
        """A sweep job whose config or input is bad: rank 0 records it as failed in its job
        directory; with `announce` (--keep-going: the sweep goes on) its problems are printed."""
        from recsys_pipe.runtime.status import RunStatus

        number, overrides, job_dir = job
        label = f"job {number} ({' '.join(overrides)})"
        self._failed_jobs.append(label)
        if int(os.environ.get("RANK", "0")) == 0:
            os.makedirs(job_dir, exist_ok=True)
            RunStatus(job_dir, overrides=overrides).write(
                "failed",
                exit_code=EXIT_CONFIG_ERROR,
                message="invalid config or input, not run: " + "; ".join(str(p) for p in exc.problems),
            )
        if announce and first_to_report():
            for p in exc.problems:
                print(f"error: {p} [sweep {label}]", file=sys.stderr)

    def run(self, argv: Sequence[str] | None = None) -> int:
        """Run with `argv` (default: sys.argv[1:]) and return the exit code."""
        register_schemas()
        self._started = False
        self._failed_jobs = []
        self._jobs_done = 0
        self._sweep = SweepLog()
        self._hydra_mode = HYDRA_MODE_UNKNOWN  # `hydra.mode` of a config _check_job composed
        argv = list(sys.argv[1:] if argv is None else argv)
        self._keep_going = KEEP_GOING in argv
        self._check_only = CHECK_ONLY in argv
        argv = [quoted_home(a) for a in argv if a not in (KEEP_GOING, CHECK_ONLY)]
        try:
            checked = self._check_jobs(argv)
        except UserCodeError as exc:  # `--check` ran the user's builder, which raised
            _report_user_code(exc, None, debug="debug=true" in argv)
            return EXIT_FAILURE
        except KeyboardInterrupt:
            return self._interrupted_at_start()
        if isinstance(checked, int):
            return checked
        if self._check_only:
            print(f"{self.prog}: config OK: {self._jobs_checked} job(s) checked, nothing was started")
            return EXIT_OK
        argv = checked
        entry = hydra_main(self._task, CONF_DIR, self.config_name, mode=self._hydra_mode)
        # Hydra names the job after the task function's file unless the config says otherwise.
        saved = sys.argv
        sys.argv = [self.prog, *argv]
        try:
            entry()
            code = 0
        except KeyboardInterrupt:  # Ctrl-C before or after training (training handles its own)
            return self._interrupted_at_start()
        except BrokenPipeError:  # `recsys-train --help | head`: the reader left; not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_OK
        except SystemExit as exc:
            code = _exit_code(exc.code)
            if code == 1 and not self._started:
                # Hydra failed before our task ran although the config composed here: it printed why
                print(
                    f"{self.prog}: the config could not be composed (see above), nothing was started. "
                    f"`{self.prog} --help` lists the groups and keys.",
                    file=sys.stderr,
                )
                return EXIT_CONFIG_ERROR
        except Exception:  # HYDRA_FULL_ERROR=1 re-raises instead of exiting
            if not self._started:
                traceback.print_exc()
                return EXIT_CONFIG_ERROR
            raise
        finally:
            sys.argv = saved
            clear_global_hydra()
            if self._sweep.jobs and int(os.environ.get("RANK", "0")) == 0:
                print(self._sweep.summary(self.prog, self._jobs_checked), file=sys.stderr)
        if code == 0 and self._failed_jobs:
            if first_to_report():
                print(
                    f"{self.prog}: {len(self._failed_jobs)} sweep job(s) had an invalid config and did not run "
                    f"({'; '.join(self._failed_jobs)}); the others ran. Each is recorded as failed in its job "
                    "directory (status.json).",
                    file=sys.stderr,
                )
            code = EXIT_CONFIG_ERROR
        if code == 0 and ("--help" in argv or "-h" in argv):
            try:
                self._print_keys([a for a in argv if a not in ("--help", "-h")])
            except BrokenPipeError:  # `recsys-train --help | head`
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return code

    def _interrupted_at_start(self) -> int:
        """Ctrl-C outside training (which handles its own): one line (rank 0's), exit 130 (the
        Ctrl-C consumed: a process that goes on starts its next run without it)."""
        _ctrl_c.settle(0)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{self.prog}: interrupted (Ctrl-C); nothing was trained", file=sys.stderr)
        return EXIT_INTERRUPTED

    def _check_jobs(self, argv: list[str]) -> int | list[str]:
        """Compose and validate the config of every job before Hydra runs any: EXIT_CONFIG_ERROR
        after reporting the problems, or the arguments to run Hydra with (`argv`, where an
        override of a schema key that no YAML file spells out is made `++key=value`)."""
        try:
            args = parse_hydra_args(argv)
        except SystemExit:  # a bad flag: Hydra's own parser reports it the same way
            return argv
        if any(getattr(args, flag, None) for flag in ("help", "hydra_help", "shell_completion", "info", "config_path")):
            return argv
        given = list(args.overrides)
        search_dirs = [CONF_DIR, *_search_dirs(given)]
        extra = []
        if args.config_dir:
            search_dirs.append(Path(args.config_dir).resolve())
            extra = [f"hydra.searchpath=[file://{search_dirs[-1]}]"]
        config_name = args.config_name or self.config_name
        try:
            jobs = sweep_jobs(given) if args.multirun else [given]
            self._multirun = bool(args.multirun)
        except Exception as exc:
            return self._report(self._composition_error(exc, search_dirs))
        swept = _swept_keys(jobs)
        self._jobs_checked = len(jobs)
        self._sweep.swept = {key.lstrip("+~") for key in swept}
        added: set[str] = set()
        bad: list[tuple[int, list[str], ConfigError]] = []
        for number, job in enumerate(jobs):
            error = self._check_job(extra, job, config_name, search_dirs, not args.cfg, added)
            if error is not None:
                bad.append((number, [o for o in job if o.split("=", 1)[0] in swept], error))
        if added:  # rewrite the command line as _check_job did each job's overrides
            argv = [f"++{a}" if a.split("=", 1)[0] in added else a for a in argv]
        if not bad:
            return argv
        if not args.multirun:
            return self._report(bad[0][2])
        if self._keep_going and len(bad) < len(jobs) and not self._check_only:
            return argv  # each bad job fails in turn and is recorded (_record_failed_job)
        problems = [
            ConfigProblem(p.path, f"{p.message} [sweep job {number}: {' '.join(job)}]")
            for number, job, error in bad
            for p in error.problems
        ]
        outcome = (
            f"{len(bad)} of {len(jobs)} sweep jobs are invalid, no job was started ({KEEP_GOING} runs the valid ones)"
        )
        return self._report(ConfigError(problems), outcome)

    def _check_job(
        self,
        extra: list[str],
        overrides: list[str],
        config_name: str,
        search_dirs: list[Path],
        validate: bool,
        added: set[str],
    ) -> ConfigError | None:
        """The ConfigError of one job's config, or None.

        A key of the schema that the composed YAML does not list (a component's default left
        to its pydantic Field, e.g. `optimizer.lr` of `optimizer=adamw`) is refused by Hydra's
        struct mode; such an override is valid here, so it is retried as `++key=value` (and
        its key added to `added`, for the command line Hydra gets)."""
        overrides = [f"++{o}" if o.split("=", 1)[0] in added else o for o in overrides]
        for _ in range(len(overrides) + 1):
            try:
                cfg = compose_config(*extra, *overrides, config_name=config_name)
                break
            except Exception as exc:
                key = self._schema_key_not_in_yaml(exc, overrides)
                if not isinstance(key, str):
                    if debug_requested() or "debug=true" in overrides:
                        traceback.print_exc()
                    return key or self._composition_error(exc, search_dirs)
                added.add(key)
                overrides = [f"++{o}" if o.split("=", 1)[0] == key else o for o in overrides]
        else:
            return None  # not reached: each retry forces one more override
        self._hydra_mode = cfg.hydra.mode
        validator = self.check if self._check_only else self.sweep_check if self._multirun else self.validate
        if validate and validator is not None:
            job = composed_job(cfg)  # the run directory it names, checked as the run checks it
            with open_dict(cfg):
                del cfg["hydra"]
            try:
                with checked_job(job):
                    validator(cfg)
            except ConfigError as exc:
                if debug_requested(cfg):
                    traceback.print_exc()
                return exc
        return None

    def _schema_key_not_in_yaml(self, exc: BaseException, overrides: list[str]) -> str | ConfigError | None:
        """The override key Hydra refused as not in the config although the schema has it; or
        the ConfigError of an override below the key Hydra names that the schema does not have
        (`data.columns.sparse.user.num_embedings`: named as typed, with the keys it is close to)."""
        from omegaconf.errors import ConfigAttributeError, ConfigKeyError

        from recsys_pipe.cli.keys import closest_listed, describe_keys, format_suggestions, key_matches, misspelt_entry
        from recsys_pipe.config import import_fn

        if not self.schema:
            return None
        error: BaseException | None = exc
        while error is not None and not isinstance(error, (ConfigKeyError, ConfigAttributeError)):
            error = error.__cause__ or error.__context__
        path = getattr(error, "full_key", None)
        parent = getattr(error, "parent_node", None)
        if not path or parent is None:
            return None
        keys = [o.split("=", 1)[0] for o in overrides]
        key = next((k for k in keys if k == path or k.startswith(f"{path}.")), None)  # or a section above it
        if key is None:
            return None
        values = OmegaConf.to_container(parent._get_root(), resolve=False)
        known = [p for p, _, _ in describe_keys(import_fn(self.schema), values)]
        pattern = next((pattern for pattern in known if key_matches(key, pattern)), None)
        if pattern is not None:
            return None if misspelt_entry(key, pattern, values) else key
        if key == path:
            return None  # Hydra's own error names it
        return ConfigError(ConfigProblem(key, f"unknown key{format_suggestions(closest_listed(key, known))}"))

    def _composition_error(self, exc: BaseException, search_dirs: list[Path]) -> ConfigError:
        from recsys_pipe.cli.compose_errors import composition_error
        from recsys_pipe.config import import_fn

        schema = import_fn(self.schema) if self.schema else None
        groups = sorted({p.name for d in search_dirs if d.is_dir() for p in d.iterdir() if p.is_dir()} - {"hydra"})
        return composition_error(exc, schema, search_dirs, groups)

    def _report(self, error: ConfigError, outcome: str | None = None) -> int:
        report_config_error(error, self.prog, outcome=outcome)
        sys.stdout.flush()
        return EXIT_CONFIG_ERROR

    def _print_keys(self, overrides: list[str]) -> None:
        """`--help`'s last part: every key with its value (with `overrides`) and description."""
        from recsys_pipe.cli.keys import describe_keys, format_keys
        from recsys_pipe.config import import_fn

        try:
            cfg = compose_config(*(o for o in overrides if not o.startswith("-")), config_name=self.config_name)
            footer = OmegaConf.select(cfg, "hydra.help.footer", default="")
            with open_dict(cfg):
                del cfg["hydra"]
            # a required key not given yet (`data=criteo` without `data.path`) is listed as `???`:
            # the help is how a user finds out what to set
            values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        except Exception as exc:  # the groups listing above is still useful
            print(f"(keys not listed: the config could not be composed: {exc})")
            return
        if self.schema:
            print("== Keys ==")
            print("Every key, its value with these overrides, and what it does (override any with path=value):\n")
            print(format_keys(describe_keys(import_fn(self.schema), values)))
        print(f"\n{footer}" if footer else "")
        sys.stdout.flush()

    def main(self) -> None:
        """Console-script entry point."""
        sys.exit(self.run())


def _report_user_code(exc: UserCodeError, cfg: Any, debug: bool = False) -> None:
    """`error: <key> (<builder>) raised <exception>` and the user's frames (once per torchrun
    job); debug=true adds the whole traceback."""
    from recsys_pipe.runtime.failures import user_code_report

    if not first_to_report():
        return
    if debug or debug_requested(cfg):
        traceback.print_exception(exc)
    print(user_code_report(exc), file=sys.stderr)
    sys.stderr.flush()


def _swept_keys(jobs: list[list[str]]) -> set[str]:
    """Keys whose value differs between the jobs (what names a job)."""
    values: dict[str, set[str]] = {}
    for job in jobs:
        for override in job:
            key, _, value = override.partition("=")
            values.setdefault(key, set()).add(value)
    return {k for k, v in values.items() if len(v) > 1}


def _search_dirs(overrides: list[str]) -> list[Path]:
    """Directories added by a `hydra.searchpath=[file://...]` override (to locate a bad key)."""
    dirs = []
    for override in overrides:
        if override.lstrip("+").startswith("hydra.searchpath="):
            dirs += [Path(p) for p in re.findall(r"file://([^,\]\s'\"]+)", override)]
    return dirs


def _sweep_job() -> tuple[int, list[str], str] | None:
    """(job number, its swept overrides, its directory) when running a job of a `-m` sweep."""
    runtime = hydra_runtime()
    if runtime is None or not runtime.multirun:
        return None
    return runtime.job_num, list(runtime.task_overrides), str(runtime.output_dir)


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
