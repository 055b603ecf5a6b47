"""Protocol v2's pilot (research/study_planner/study_planner_v2.md): every arm and every fixed sampling rule on
the pilot seed, each run exactly as an analysed run (to the budget B, on its grid); an arm
that fails the learning criterion runs again with its step size scaled by each factor of
`study.step_grid`; then rule.json (each arm's step, fixed-best, the fixed target).

Layout under OUT/pilot/: `<label>-seed<pilot>/` at the protocol's step size and
`<label>-x<factor>-seed<pilot>/` for the grid's runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tomllib

from fedlora.errors import ConfigError
from fedlora.federation.rundir import load_saved_config
from fedlora.studies.runs import load_run
from research.study_planner.study_rule import choose_step, derive_rule_v2, learning, metric_points
from research.study_planner.study_spec import FIXED_BEST, StudySpec, chosen_names

RULE_FILE = "rule.json"  # under the study directory: written once the pilot has finished


def budget_overrides(budget_s: float, grid_s: float, round_cap: int) -> list[str]:
    """What every run of the rule shares: it stops at the round that spends B and is
    evaluated every B / grid_points seconds of simulated time (and at that round)."""
    return [
        f"training.time_budget_s={budget_s!r}",
        f"training.eval_every_s={grid_s!r}",
        f"training.eval_every={round_cap}",
        f"training.rounds={round_cap}",
    ]


def step_override(spec: StudySpec, overrides: Sequence[str], factor: float) -> list[str]:
    """The arm's step size (spec.step_key) times `factor`; nothing for factor 1."""
    if factor == 1.0:
        return []
    value = spec.step_value(overrides) * factor
    return [f"{spec.step_key(overrides)}={value!r}"]


def drop_stop_override(spec: StudySpec, run_dir: Path, factor: float) -> list[str]:
    """Amendment 5: a grid run (factor != 1) stops at its first evaluation more than
    learn_max_drop below round 0 (`training.stop_accuracy_drop`): from there it cannot meet
    the learning criterion, and rule 7 takes only a factor that does, so its later rounds
    decide nothing. Runs at the protocol's step always run to B (rules 7 and 8 read their
    value at B). A grid run started before the amendment resumes as it was written."""
    if factor == 1.0 or not spec.grid_stops_at_drop:
        return []
    saved = run_dir / "config.toml"
    if saved.is_file() and not load_saved_config(saved).training.stop_accuracy_drop:
        return []
    return [f"training.stop_accuracy_drop={spec.learn_max_drop!r}"]


def pilot_dir(out: Path, label: str, factor: float, seed: int) -> Path:
    tag = "" if factor == 1.0 else f"-x{factor:g}"
    return out / "pilot" / f"{label}{tag}-seed{seed}"


def pilot_jobs(spec: StudySpec, out: Path, finished: Any) -> tuple[list[tuple[str, float]], bool]:
    """The pilot's (label, factor) jobs known now, and whether the list is complete: the
    grid's runs of an arm are known once its run at the protocol's step has finished."""
    jobs, complete = [], True
    for label in spec.pilot_labels:
        jobs.append((label, 1.0))
        base = pilot_dir(out, label, 1.0, spec.pilot_seed)
        if not finished(base):
            complete = False
            continue
        crit = learning(
            metric_points(load_run(base), spec.metric),
            spec.metric,
            spec.budget_s,
            spec.learn_min_gain,
            spec.learn_max_drop,
        )
        if not crit.learned:
            jobs += [(label, f) for f in spec.step_grid]
    return jobs, complete


def arm_factor(spec: StudySpec, out: Path, label: str, finished: Any) -> tuple[float | None, str]:
    """(the step factor rule.json will give `label`, "") once every pilot run of that arm has
    finished, else (None, what it waits for). An arm's factor depends on its own pilot runs
    only (`choose_step`, as `derive_rule_v2` calls it), so its analysed runs may start before
    the other arms' pilots end; fixed-best is known only from every fixed rule's pilot."""
    jobs, _ = pilot_jobs(spec, out, finished)
    mine = [f for lab, f in jobs if lab == label]
    waiting = [f"x{f:g}" for f in mine if not finished(pilot_dir(out, label, f, spec.pilot_seed))]
    if waiting:
        return None, f"its pilot run(s) {', '.join(waiting)} have not finished"
    factor, _ = choose_step(
        trials(spec, out, label, mine),
        spec.metric,
        spec.budget_s,
        spec.learn_min_gain,
        spec.learn_max_drop,
    )
    return factor, ""


def trials(
    spec: StudySpec, out: Path, label: str, factors: Sequence[float]
) -> dict[float, list[tuple[float, float]]]:
    """{step factor: the metric's points} of one arm's pilot runs."""
    return {
        f: metric_points(load_run(pilot_dir(out, label, f, spec.pilot_seed)), spec.metric)
        for f in factors
    }


def derive(spec: StudySpec, out: Path, jobs: list[tuple[str, float]]) -> dict[str, Any]:
    """rule.json's content from the finished pilot."""
    labels = dict.fromkeys(label for label, _ in jobs)
    pilot = {lab: trials(spec, out, lab, [f for x, f in jobs if x == lab]) for lab in labels}
    rule = derive_rule_v2(
        pilot,
        spec.metric,
        spec.budget_s,
        spec.target_gain,
        spec.hold_evals,
        list(spec.fixed_rules),
        spec.learn_min_gain,
        spec.learn_max_drop,
    )
    rule["step_keys"] = {lab: spec.step_key(ov) for lab, ov in spec.pilot_labels.items()}
    rule["step_values"] = {
        lab: spec.step_value(ov) * rule["steps"][lab] for lab, ov in spec.pilot_labels.items()
    }
    rule["step_grid"] = list(spec.step_grid)
    rule["noninferiority_margin"] = spec.noninferiority_margin
    return rule


def check_written(path: Path, rule: dict[str, Any]) -> bool:
    """True when `path` holds this rule; refused when it holds another (fixed once written)."""
    if not path.is_file():
        return False
    old = json.loads(path.read_text(encoding="utf-8"))
    if old != json.loads(json.dumps(rule)):
        raise ConfigError(f"{path} exists with another rule: the rule is fixed once written")
    return True


def early_arms(
    spec: StudySpec, out: Path, arms_only: Sequence[str], finished: Any
) -> tuple[dict[str, list[str]], dict[str, float]]:
    """The arms of `run --arms` and their step factors before rule.json exists: each must be
    an arm (not fixed-best) whose own pilot runs have all finished."""
    if not arms_only:
        raise ConfigError(
            f"no {out / RULE_FILE}: the pilot has not finished; before it does, name with "
            "--arms the arms whose own pilot has finished (their step is known)"
        )
    chosen_names("run --arms", arms_only, [*spec.arms, FIXED_BEST])
    steps: dict[str, float] = {}
    for label in arms_only:
        if label == FIXED_BEST:
            raise ConfigError(
                f"run --arms {FIXED_BEST}: it waits for {out / RULE_FILE} (the best fixed rule "
                "is chosen from every fixed rule's pilot)"
            )
        factor, waits = arm_factor(spec, out, label, finished)
        if factor is None:
            raise ConfigError(f"run --arms {label}: no {out / RULE_FILE} yet and {waits}")
        steps[label] = factor
    return {lab: spec.arms[lab] for lab in arms_only}, steps


def check_saved_step(spec: StudySpec, run_dir: Path, overrides: Sequence[str]) -> None:
    """Refuse a run directory whose saved step size is not the one its arm runs at now
    (an analysed run started before rule.json, under a step the rule did not choose)."""
    path = run_dir / "config.toml"
    if not path.is_file():
        return
    key = spec.step_key(overrides)
    section, name = key.split(".")
    saved = tomllib.loads(path.read_text(encoding="utf-8")).get(section, {}).get(name)
    want = spec.step_value(overrides)
    # fedlora writes every key into config.toml; one without the key is not its dump
    if saved is not None and not math.isclose(float(saved), want, rel_tol=1e-12):
        raise ConfigError(
            f"{path}: {key} = {saved!r}, but the study runs this arm at {want!r}; move the run "
            "directory away to start it again"
        )
