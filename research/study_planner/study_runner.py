"""The planner study's runner (research/study_planner/study_planner.py): the pilot stage (the fixed sampling
rules and FSLoRA on the pilot seed, each on the pilot's own evaluation grid; then rule.json)
and the analysed runs (every arm on every seed, on the budget's common grid), resumable.

Layout of the output directory:

    pilot/<label>-seed<pilot>/   the pilot's runs (reported, never analysed)
    <label>-seed<s>/             the analysed runs
    rule.json                    budget, target gain, fixed-best, arms: written by the pilot
    ledger.jsonl                 one line per finished run: a restart skips it

A run is *finished* when its summary.json exists without an error; a run directory with a
config.toml but no such summary is resumed; anything else is started (again).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedlora.errors import ConfigError, DataError
from fedlora.studies.runs import load_run
from research.study_planner import study_pilot
from research.study_planner.study_rule import derive_rule, metric_points, pilot_budget
from research.study_planner.study_spec import FIXED_BEST, REFERENCE, StudySpec, chosen_names

RULE_FILE = study_pilot.RULE_FILE
# an analysed run stops at the round that spends the budget B; the config's round cap is the
# pilot's, and an arm whose rounds are cheap in simulated time (FSLoRA, HeteroLoRA) needs
# more rounds than it to spend B, so the analysed runs' cap only guards against a run that
# never spends it
ANALYSED_ROUND_CAP = 100_000
# what `--commit` commits of a finished run: what the report reads and a reviewer re-plots,
# never its checkpoints, adapter, lock or ownership marker (megabytes a run, and not results)
RESULT_FILES = (
    "config.toml",
    "metrics.jsonl",
    "predictions.jsonl",
    "summary.json",
    "clients.csv",
    "plan.json",
    "machine.jsonl",  # which machine computed which rounds (fedlora.federation.machine_log)
)
LEDGER_FILE = "ledger.jsonl"
PILOT_DIR = "pilot"
Log = Callable[[str], None]
RunFn = Callable[..., dict[str, Any]]


def _default_run(cfg: Any, run_dir: Path, *, resume: bool) -> dict[str, Any]:
    from fedlora.federation.run import run

    return run(cfg, run_dir, resume=resume, quiet=True)


def finished(run_dir: Path) -> bool:
    """summary.json exists and records no error."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return False
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and "error" not in summary


class Ledger:
    """ledger.jsonl: the runs recorded as finished (name relative to the study directory)."""

    def __init__(self, out: Path) -> None:
        self.path = out / LEDGER_FILE
        self.done: set[str] = set()
        if self.path.is_file():
            for raw in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    self.done.add(json.loads(raw)["run"])
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line of a killed runner
        self.out = out

    def record(self, run_dir: Path, compute_s: float) -> None:
        name = run_dir.relative_to(self.out).as_posix()
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        line = {
            "run": name,
            "sim_time_s": summary.get("sim_time_s"),
            "rounds": summary.get("rounds"),
            "compute_s": round(compute_s, 1),
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        self.done.add(name)


def git_commit(paths: Sequence[Path], message: str) -> None:
    """`git add` and `git commit` only `paths` (the finished run and the ledger)."""
    top = subprocess.run(
        ["git", "-C", str(paths[0].parent), "rev-parse", "--show-toplevel"],
        capture_output=True,
        text=True,
        check=False,
    )
    if top.returncode:
        raise ConfigError(f"--commit: {paths[0]} is not inside a git repository")
    cwd = top.stdout.strip()
    names = [str(p.resolve()) for p in paths]
    for argv in (["add", "--", *names], ["commit", "-q", "-m", message, "--", *names]):
        _git_when_unlocked(argv, cwd)


def _git_when_unlocked(argv: list[str], cwd: str, wait_s: float = 120.0) -> None:
    """Run git, waiting while another runner (one per core) holds the index lock."""
    deadline = time.monotonic() + wait_s
    while True:
        done = subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True)
        if done.returncode == 0:
            return
        if "index.lock" not in done.stderr or time.monotonic() > deadline:
            raise subprocess.CalledProcessError(done.returncode, ["git", *argv], stderr=done.stderr)
        time.sleep(1.0)


def run_job(
    spec: StudySpec,
    out: Path,
    run_dir: Path,
    overrides: Sequence[str],
    *,
    ledger: Ledger,
    run_fn: RunFn | None = None,
    commit: bool = False,
    log: Log = print,
) -> str:
    """Run one (label, seed) unless the ledger or its summary says it finished; returns
    "skipped", "resumed" or "started"."""
    name = run_dir.relative_to(out).as_posix()
    if name in ledger.done and finished(run_dir):
        log(f"{name}: finished earlier, skipped")
        return "skipped"
    if finished(run_dir):  # finished, but the runner was stopped before recording it
        ledger.record(run_dir, 0.0)
        log(f"{name}: finished earlier (recorded now), skipped")
        return "skipped"
    cfg = spec.config(overrides)
    resume = (run_dir / "config.toml").is_file()
    if not resume:
        (run_dir / "summary.json").unlink(missing_ok=True)  # a start that failed: again
    log(f"{name}: {'resuming' if resume else 'starting'}")
    t0 = time.perf_counter()
    (run_fn or _default_run)(cfg, run_dir, resume=resume)
    if not finished(run_dir):
        raise DataError(f"{name}: the run ended without a finished summary.json")
    ledger.record(run_dir, time.perf_counter() - t0)
    if commit:
        git_commit([*result_files(run_dir), ledger.path], f"study_planner: {name} finished")
    return "resumed" if resume else "started"


def result_files(run_dir: Path) -> list[Path]:
    """The files of a run that the study commits: those of RESULT_FILES it has, and the same
    of each of its separate calibration runs (calibration/run-*: their rounds are on the
    run's clock, and plan.json is fitted from them)."""
    dirs = [run_dir, *sorted(p for p in (run_dir / "calibration").glob("run-*") if p.is_dir())]
    return [d / name for d in dirs for name in RESULT_FILES if (d / name).is_file()]


def pilot_overrides(spec: StudySpec, overrides: Sequence[str]) -> list[str]:
    """A pilot run: its own evaluation grid (time and/or rounds), no budget, the round cap."""
    every = spec.pilot_eval_every or spec.round_cap()
    return [
        *overrides,
        f"training.seed={spec.pilot_seed}",
        "training.time_budget_s=0",
        f"training.eval_every_s={spec.pilot_eval_every_s!r}",
        f"training.eval_every={every}",
    ]


def pilot_stage(
    spec: StudySpec,
    out: Path,
    *,
    run_fn: RunFn | None = None,
    commit: bool = False,
    log: Log = print,
    only: Sequence[str] = (),
) -> dict[str, Any] | None:
    """Run the pilot's jobs on the pilot seed, derive the rule, write rule.json (refused when
    one with another rule exists). Returns the rule. `only`: run just these labels (one
    runner per core); the rule is derived once every pilot run has finished, and None is
    returned before that. The first rule: the fixed rules and FSLoRA, each on the pilot's
    own grid to the round cap; protocol v2 (`pilot_all_arms`): every arm and fixed rule to
    the budget, and the step-size grid for the arms that do not learn (study_pilot)."""
    out.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(out)
    chosen = chosen_names("pilot --only", only, list(spec.pilot_labels))
    if spec.pilot_all_arms:
        return _pilot_v2(spec, out, ledger, run_fn, commit, log, chosen)
    jobs = spec.pilot_labels
    dirs = {label: out / PILOT_DIR / f"{label}-seed{spec.pilot_seed}" for label in jobs}
    for label, overrides in jobs.items():
        if label not in chosen:
            continue
        run_job(
            spec,
            out,
            dirs[label],
            pilot_overrides(spec, overrides),
            ledger=ledger,
            run_fn=run_fn,
            commit=commit,
            log=log,
        )
    waiting = [label for label, d in dirs.items() if not finished(d)]
    if waiting:
        log(f"pilot: {', '.join(waiting)} not finished yet; rule.json waits for every pilot run")
        return None
    pts = {lab: metric_points(load_run(d), spec.metric) for lab, d in dirs.items()}
    runs = {lab: load_run(d) for lab, d in dirs.items()}
    budget = spec.budget_s or pilot_budget(runs[REFERENCE].total_time_s, spec.budget_round_s)
    rule = derive_rule(pts, spec.metric, budget, spec.target_fraction, list(spec.fixed_rules))
    rule.update(study_fields(spec, budget))
    return _write_rule(out, rule, commit, log)


def _write_rule(out: Path, rule: dict[str, Any], commit: bool, log: Log) -> dict[str, Any]:
    path = out / RULE_FILE
    if not study_pilot.check_written(path, rule):
        path.write_text(json.dumps(rule, indent=2) + "\n", encoding="utf-8")
        if commit:
            git_commit([path], "study_planner: rule.json from the pilot")
    log(json.dumps({k: rule[k] for k in ("budget_s", "target_gain", "fixed_best")}))
    return rule


def _pilot_v2(
    spec: StudySpec,
    out: Path,
    ledger: Ledger,
    run_fn: RunFn | None,
    commit: bool,
    log: Log,
    chosen: list[str],
) -> dict[str, Any] | None:
    grid_s = spec.budget_s / spec.grid_points
    common = study_pilot.budget_overrides(spec.budget_s, grid_s, ANALYSED_ROUND_CAP)
    done: set[tuple[str, float]] = set()
    while True:  # the grid's jobs appear as the runs at the protocol's step finish
        jobs, complete = study_pilot.pilot_jobs(spec, out, finished)
        todo = [(lab, f) for lab, f in jobs if lab in chosen and (lab, f) not in done]
        if not todo:
            break
        for label, factor in todo:
            overrides = spec.pilot_labels[label]
            run_dir = study_pilot.pilot_dir(out, label, factor, spec.pilot_seed)
            run_job(
                spec,
                out,
                run_dir,
                [
                    *overrides,
                    *study_pilot.step_override(spec, overrides, factor),
                    *common,
                    *study_pilot.drop_stop_override(spec, run_dir, factor),
                    f"training.seed={spec.pilot_seed}",
                ],
                ledger=ledger,
                run_fn=run_fn,
                commit=commit,
                log=log,
            )
            done.add((label, factor))
    waiting = [
        f"{lab} x{f:g}"
        for lab, f in jobs
        if not finished(study_pilot.pilot_dir(out, lab, f, spec.pilot_seed))
    ]
    if waiting or not complete:
        log(f"pilot: {', '.join(waiting)} not finished yet; rule.json waits for every pilot run")
        return None
    rule = study_pilot.derive(spec, out, jobs)
    rule.update(study_fields(spec, spec.budget_s))
    return _write_rule(out, rule, commit, log)


def study_fields(spec: StudySpec, budget: float) -> dict[str, Any]:
    """What the report needs beside the pilot's numbers (it reads run directories and this)."""
    arms = {**spec.arms, FIXED_BEST: None}
    return {
        "seeds": list(spec.seeds),
        "pilot_seed": spec.pilot_seed,
        "secondary": [m.text for m in spec.secondary],
        "grid_s": budget / spec.grid_points,
        "pilot_eval_every_s": spec.pilot_eval_every_s,
        "pilot_eval_every": spec.pilot_eval_every,
        "target_fraction": spec.target_fraction,
        "arms": list(arms),
        "baselines": list(spec.baselines),
        "proposed": spec.proposed,
        "overrides": {**spec.arms, **spec.fixed_rules},
        "budget_from_config": bool(spec.budget_s),
    }


def read_rule(out: Path) -> dict[str, Any]:
    path = out / RULE_FILE
    if not path.is_file():
        raise ConfigError(f"no {path}: run the pilot stage first (it writes the rule)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a JSON rule ({e})") from None


def run_stage(
    spec: StudySpec,
    out: Path,
    *,
    run_fn: RunFn | None = None,
    commit: bool = False,
    log: Log = print,
    seeds: Sequence[int] = (),
    arms_only: Sequence[str] = (),
) -> list[str]:
    """Every arm on every analysed seed, with the rule's budget and common grid; returns each
    job's outcome (skipped/resumed/started) in order. `seeds` / `arms_only`: run just these
    (one runner per core; each job's config does not depend on which runner runs it).

    Before rule.json exists (protocol v2), `arms_only` may name arms whose own pilot has
    finished: their step factor is the one the rule will record (`study_pilot.arm_factor`),
    so their analysed runs need not wait for the other arms' pilots. Every run already
    started is checked against the step the rule gives it."""
    if (out / RULE_FILE).is_file() or not spec.pilot_all_arms:
        rule = read_rule(out)
        fixed_best = rule["fixed_best"]
        if fixed_best not in spec.fixed_rules:
            raise ConfigError(
                f"{out / RULE_FILE}: fixed_best {fixed_best!r} is not a fixed rule of the study "
                f"config (allowed: {', '.join(spec.fixed_rules)})"
            )
        arms = {**spec.arms, FIXED_BEST: spec.fixed_rules[fixed_best]}
        steps = dict(rule.get("steps", {}))  # protocol v2: each arm's chosen step factor
        steps[FIXED_BEST] = steps.get(fixed_best, 1.0)
        budget, grid_s = rule["budget_s"], rule["grid_s"]
    else:
        arms, steps = study_pilot.early_arms(spec, out, arms_only, finished)
        budget, grid_s = spec.budget_s, spec.budget_s / spec.grid_points  # as study_fields
    # every arm stops at the round that spends B
    common = study_pilot.budget_overrides(budget, grid_s, ANALYSED_ROUND_CAP)
    arms = {
        lab: [*ov, *study_pilot.step_override(spec, ov, steps.get(lab, 1.0))]
        for lab, ov in arms.items()
    }
    chosen_seeds = chosen_names(
        "run --seeds", [str(x) for x in seeds], [str(x) for x in spec.seeds]
    )
    chosen_arms = chosen_names("run --arms", arms_only, list(arms))
    ledger = Ledger(out)
    outcomes = []
    for seed in spec.seeds:
        if str(seed) not in chosen_seeds:
            continue
        for label, overrides in arms.items():
            if label not in chosen_arms:
                continue
            run_dir = out / f"{label}-seed{seed}"
            study_pilot.check_saved_step(spec, run_dir, overrides)
            outcomes.append(
                run_job(
                    spec,
                    out,
                    run_dir,
                    [*overrides, *common, f"training.seed={seed}"],
                    ledger=ledger,
                    run_fn=run_fn,
                    commit=commit,
                    log=log,
                )
            )
    return outcomes


def stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
