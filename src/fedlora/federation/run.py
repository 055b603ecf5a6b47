"""The one way into a run: `run(cfg, run_dir, resume=...)`, what `fedlora run` and
`fedlora compare` call. A run is checked, locked and resolved here, once each, and the
resolved values are passed on; nothing after this module does any of it again:

    check_inputs(cfg)          the inputs (`fedlora.federation.preflight`); a new run before
                               anything is created, a resume once its saved config is read
    resolve_runtime(cfg)       model.device / model.dtype made concrete (`fedlora.llm.device`);
                               the `Resolution` goes to `build_run`, the model loader and the
                               calibration runs, and its values into config.toml
    run_dir_lock(run_dir)      held for the whole run, Algorithm 2's calibration runs included
                               (they live in run_dir/calibration); the Flower ServerApp is
                               another process and takes its own
    prepare_proposed(...)      `proposed`: the plan; with planner.calibration = "separate"
                               Algorithm 2's four calibration runs first
                               (`fedlora.federation.calibration`), each run by `run_in_process`,
                               handed in as a function
    run_in_process(...)        the run itself (`fedlora.federation.engine`)

A resume whose checkpoints were deleted is refused before anything loads
(`refuse_lost_checkpoints`): starting again from round 0 would discard its recorded rounds.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedlora.config.experiment import ExperimentConfig
from fedlora.errors import DataError
from fedlora.federation.calibration import plan_outcome, prepare_proposed
from fedlora.federation.checkpoints import checkpoint_paths
from fedlora.federation.engine import run_in_process
from fedlora.federation.preflight import check_inputs
from fedlora.federation.rundir import (
    check_run_dir,
    load_run_config,
    run_dir_lock,
    write_run_dir,
)
from fedlora.federation.runfiles import read_metrics_lines
from fedlora.llm.device import Resolution, resolve_runtime

Log = Callable[[str], Any]


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
    `overwrite`), or with `resume` continue the one there; returns its summary.

    On resume `cfg` is what the user gives on top of the saved config (None: the saved
    config as it is); a difference is refused unless `force` (`load_run_config`).
    """
    run_dir = Path(run_dir)
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if resume:
        load_run_config(run_dir)  # a missing or foreign directory: refused before the lock
        with run_dir_lock(run_dir):
            cfg = load_run_config(run_dir, cfg, force=force)
            check_inputs(cfg)
            runtime = resolve_runtime(cfg)
            refuse_lost_checkpoints(run_dir, cfg.training.checkpoint_every)
            return _run_method(runtime, run_dir, resume=True, quiet=quiet, log=log)
    if cfg is None:
        raise ValueError("run: a new run needs its config")
    check_inputs(cfg)  # before anything is created or replaced
    runtime = resolve_runtime(cfg)  # a device this machine lacks fails here too
    check_run_dir(run_dir, overwrite=overwrite)
    with run_dir_lock(run_dir):  # a live run (a Flower ServerApp too) is never replaced
        write_run_dir(runtime.cfg, run_dir, overwrite=overwrite)
        return _run_method(runtime, run_dir, resume=False, quiet=quiet, log=log)


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
        dataclasses.replace(runtime, cfg=cfg), run_dir, resume=resume, quiet=quiet, log=log,
        plan=plan, finish=add_outcome,
    )  # fmt: skip


def refuse_lost_checkpoints(run_dir: Path, checkpoint_every: int) -> None:
    """Refuse to resume an unfinished run whose checkpoints were deleted: metrics.jsonl
    records a round after the first checkpoint's (`checkpoint_every`), so checkpoints were
    written, and a resume would start again from round 0 and discard those rounds.
    `DataError` naming the directory and the remedy; metrics.jsonl is not touched.

    A run killed before its first checkpoint starts over, as it would have anyway; a
    finished run without checkpoints is refused by `fedlora.federation.runfiles.restore_metrics`.
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
