"""The one way into a run. Every path in (`fedlora run`, `fedlora compare`, `run_experiment`
for tests and benchmarks, the Flower ServerApp of `flower simulate` and `flower run-local`)
goes through `entered`, which does these steps once each, in this order:

    1. check      the inputs (`fedlora.federation.preflight.check_inputs`: the config's
                  files, data, model, the method's fields and its own rule), the caller's
                  own check (Flower's), and the run directory (a new run: may it be used or
                  replaced; a resume: the saved config with what is given on top, and
                  whether the differences are allowed)
    2. resolve    model.device / model.dtype made concrete (`fedlora.llm.device`): a device
                  this machine lacks fails here; the `Resolution` goes to `build_run`, the
                  model loader and the calibration runs, and its values into config.toml
    3. lock       `run_dir_lock`, held for the whole run, Algorithm 2's calibration runs
                  included (they live in run_dir/calibration and take none of their own)
    4. delete     with --overwrite, what the earlier run's marker lists (`write_run_dir`)
    5. write      the marker and config.toml (a resume with accepted changes: config.toml)

so nothing is deleted or started before every check passed. The whole entry and the run in
it are one `reading_once` scope: each data file is read once, by the checks, and the build
(calibration runs included) uses those records. Then `proposed` gets its plan
(`prepare_proposed`; with planner.calibration = "separate" four calibration runs, each run
by `run_in_process` on the parent's resolution under the parent's lock, writing its own
directory with `write_run_dir`) and `run_in_process` runs the rounds.

A resume whose checkpoints were deleted is refused before anything loads
(`refuse_lost_checkpoints`): starting again from round 0 would discard its recorded rounds.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedlora.config.experiment import ExperimentConfig
from fedlora.config.privacy_section import check_in_process_privacy
from fedlora.config.toml_io import dump_toml
from fedlora.errors import DataError
from fedlora.federation.calibration import plan_outcome, prepare_proposed
from fedlora.federation.checkpoints import checkpoint_paths
from fedlora.federation.engine import run_in_process
from fedlora.federation.methods.proposed import Plan
from fedlora.federation.methods.registry import resolve_method_options
from fedlora.federation.metrics_file import read_metrics_lines
from fedlora.federation.preflight import check_inputs
from fedlora.federation.rundir import (
    check_run_dir,
    load_run_config,
    refuse_unsafe_names,
    run_dir_lock,
    write_run_dir,
)
from fedlora.files import atomic_write
from fedlora.files.data import reading_once
from fedlora.llm.device import Resolution, resolve_runtime

Log = Callable[[str], Any]
Check = Callable[[ExperimentConfig], None]


@contextmanager
def entered(
    cfg: ExperimentConfig | None,
    run_dir: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    force: bool = False,
    as_given: bool = False,
    also_check: Check | None = None,
) -> Iterator[Resolution]:
    """The entry sequence (module docstring): check, resolve, lock, delete, write; yields the
    `Resolution` with the lock held. A new run needs `cfg`; `overwrite` replaces an earlier
    fedlora run there. With `resume`, `cfg` is what is given on top of the saved config (None:
    the saved config), a difference refused unless `force`; `as_given` (the library's
    `run_experiment`) resumes with `cfg` as it is. `also_check(cfg)`: the caller's own
    check (Flower's), run with the others."""
    with reading_once():  # each data file: read at the checks, used by the build
        run_dir = Path(run_dir)
        changed = False
        if resume:
            saved = load_run_config(run_dir)  # a missing or foreign directory is refused here
            if cfg is None or not as_given:
                target = load_run_config(run_dir, cfg, force=force, write=False)
                changed = target != saved
                cfg = target
        elif cfg is None:
            raise ValueError("entered: a new run needs its config")
        check_inputs(cfg)
        cfg = resolve_method_options(cfg)  # the run records the chosen method's options in full
        if also_check is not None:
            also_check(cfg)
        if not resume:
            check_run_dir(run_dir, overwrite=overwrite)
        else:
            refuse_unsafe_names(run_dir)  # a resume writes adapter/, checkpoints/, ... there
        runtime = resolve_runtime(cfg)  # a device this machine lacks fails here too
        with run_dir_lock(run_dir):  # a live run (a Flower ServerApp too) is never replaced
            if resume:
                refuse_lost_checkpoints(run_dir, cfg.training.checkpoint_every)
                if changed:  # --force: the run goes on with the accepted changes
                    atomic_write(run_dir / "config.toml", dump_toml(runtime.cfg).encode())
            else:
                write_run_dir(runtime.cfg, run_dir, overwrite=overwrite)
            yield runtime


def run(
    cfg: ExperimentConfig | None,
    run_dir: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    force: bool = False,
    quiet: bool = False,
    log: Log | None = None,
) -> dict[str, Any]:
    """Run a new experiment in `run_dir` (replacing an earlier fedlora run there only with
    `overwrite`), or with `resume` continue the one there; returns its summary: what
    `fedlora run` and `fedlora compare` call.

    On resume `cfg` is what the user gives on top of the saved config (None: the saved
    config as it is); a difference is refused unless `force` (`load_run_config`).
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    with entered(
        cfg,
        run_dir,
        resume=resume,
        overwrite=overwrite,
        force=force,
        also_check=check_in_process_privacy,
    ) as runtime:
        return _run_method(runtime, Path(run_dir), resume=resume, quiet=quiet, log=log)


def run_experiment(
    cfg: ExperimentConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    quiet: bool = False,
    log: Log | None = None,
    stop: Callable[[dict[str, Any]], bool] | None = None,
    plan: Plan | None = None,
    finish: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run (or resume, with `cfg` as given) one experiment with a given plan (no
    calibration): the library's way in for tests and benchmarks, through the same entry
    (`entered`), then `run_in_process` (`stop`, `plan`, `finish`: see there)."""
    with entered(
        cfg, run_dir, resume=resume, as_given=True, also_check=check_in_process_privacy
    ) as runtime:
        return run_in_process(
            runtime,
            Path(run_dir),
            resume=resume,
            quiet=quiet,
            log=log,
            stop=stop,
            plan=plan,
            finish=finish,
        )


def prepare_run_dir(
    cfg: ExperimentConfig,
    run_dir: Path,
    *,
    overwrite: bool = False,
    also_check: Check | None = None,
) -> Resolution:
    """The entry for a new run without running it (check, resolve, lock, delete, write; the
    lock released): a directory that `run_experiment` then runs, or that a Flower
    ServerApp in another process takes over (`flower run-local`). Returns the resolution."""
    with entered(cfg, run_dir, overwrite=overwrite, also_check=also_check) as runtime:
        return runtime


def _run_method(
    runtime: Resolution, run_dir: Path, *, resume: bool, quiet: bool, log: Log
) -> dict[str, Any]:
    """The run in this process; for `proposed` its plan first (Algorithm 2's calibration
    runs, each in this process, on the same resolved device), and `plan` in its summary."""
    cfg = runtime.cfg
    if cfg.method.name != "proposed":
        return run_in_process(runtime, run_dir, resume=resume, quiet=quiet, log=log)

    def run_one(ccfg: ExperimentConfig, sub: Path, *, resume: bool, stop) -> dict[str, Any]:
        calibration = dataclasses.replace(runtime, cfg=ccfg)  # the parent's device and dtype
        return run_in_process(calibration, sub, resume=resume, quiet=quiet, log=log, stop=stop)

    cfg, plan = prepare_proposed(cfg, run_dir, run_one=run_one, log=log)

    def add_outcome(summary: dict[str, Any]) -> None:
        summary["plan"] = plan_outcome(run_dir)

    return run_in_process(
        dataclasses.replace(runtime, cfg=cfg),
        run_dir,
        resume=resume,
        quiet=quiet,
        log=log,
        plan=plan,
        finish=add_outcome,
    )


def refuse_lost_checkpoints(run_dir: Path, checkpoint_every: int) -> None:
    """Refuse to resume an unfinished run whose checkpoints were deleted: metrics.jsonl
    records a round after the first checkpoint's (`checkpoint_every`), so checkpoints were
    written, and a resume would start again from round 0 and discard those rounds.
    `DataError` naming the directory and the remedy; metrics.jsonl is not touched.

    A run killed before its first checkpoint starts over, as it would have anyway; a
    finished run without checkpoints is refused by
    `fedlora.federation.metrics_file.restore_metrics`.
    """
    if checkpoint_paths(run_dir) or (run_dir / "summary.json").exists():
        return
    last = 0
    for text in read_metrics_lines(run_dir / "metrics.jsonl"):
        line = json.loads(text)
        if isinstance(line, dict) and isinstance(line.get("round"), int):
            last = max(last, line["round"])
    if last > checkpoint_every:
        raise DataError(
            f"--resume {str(run_dir)!r}: its checkpoints are gone but metrics.jsonl records "
            f"rounds up to {last} (a checkpoint every {checkpoint_every}): a resume would "
            "restart from round 0 and discard them; restore checkpoints/ from a backup, or "
            f"start the run again with --overwrite (or another --out)"
        )
