"""The planner study's config (research/study_planner/study_planner.toml): its `[study]` table, checked, and
the experiment sections every run starts from. The arms and fixed sampling rules are tables
of `section.key=value` overrides (`[study.arms]`, `[study.fixed_rules]`), so a tiny config
(the tests') runs the same stages with other arms.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlora.config.experiment import ExperimentConfig, config_from_dict
from fedlora.config.method_options import upgrade_renamed_keys
from fedlora.config.toml_io import apply_overrides, read_toml
from fedlora.errors import ConfigError, bad_value
from research.study_planner.study_rule import Metric, parse_metric

STUDY_KEYS = (
    "protocol_fixed",
    "seeds",
    "pilot_seed",
    "metric",
    "secondary",
    "budget_s",
    "budget_round_s",
    "target_fraction",
    "pilot_eval_every_s",
    "pilot_eval_every",
    "grid_points",
    "baselines",
    "arms",
    "fixed_rules",
    # protocol v2 (research/study_planner/study_planner_v2.md); absent, the study runs as its first rule did
    "target_gain",
    "hold_evals",
    "pilot_all_arms",
    "learn_min_gain",
    "learn_max_drop",
    "step_grid",
    "noninferiority_margin",
    "grid_stops_at_drop",
)
FIXED_BEST = "fixed-best"
REFERENCE = "fslora"  # the pilot's budget comes from its clock; the paired figure subtracts it


@dataclass(frozen=True)
class StudySpec:
    """The `[study]` table, checked; `raw` holds the experiment sections."""

    protocol_fixed: bool
    seeds: tuple[int, ...]
    pilot_seed: int
    metric: Metric
    secondary: tuple[Metric, ...]
    budget_s: float  # 0 = fixed by the pilot
    budget_round_s: float
    target_fraction: float
    pilot_eval_every_s: float
    pilot_eval_every: int  # 0 = no round grid in the pilot
    grid_points: int
    baselines: tuple[str, ...]
    arms: dict[str, list[str]]
    fixed_rules: dict[str, list[str]]
    raw: dict[str, Any] = field(repr=False)
    target_gain: float = 0.0  # > 0: the target gain fixed by the rule, not by the pilot
    hold_evals: int = 1  # consecutive evaluations at or above the target that count
    pilot_all_arms: bool = False  # the pilot runs every arm (and the fixed rules) to B
    learn_min_gain: float = 0.0  # learning criterion: the gain at B is at least this
    learn_max_drop: float = math.inf  # ... and no evaluation falls more than this below round 0
    step_grid: tuple[float, ...] = ()  # step-size factors tried by an arm that does not learn
    noninferiority_margin: float = 0.0  # > 0: "not worse at B" by seed-level t interval
    # a grid run (step factor != 1) stops at its first evaluation more than learn_max_drop
    # below round 0 (training.stop_accuracy_drop): it can no longer learn (amendment 5)
    grid_stops_at_drop: bool = False
    source: str = "research/study_planner/study_planner.toml"

    @property
    def proposed(self) -> list[str]:
        return [lab for lab in self.arms if lab.startswith("proposed")]

    @property
    def labels(self) -> list[str]:
        """Every analysed arm: the configured ones and the best fixed rule."""
        return [*self.arms, FIXED_BEST]

    def config(self, overrides: Sequence[str]) -> ExperimentConfig:
        """The experiment config of one run: the base sections with `overrides` applied."""
        raw = copy.deepcopy(self.raw)
        apply_overrides(raw, overrides, source=self.source)
        return config_from_dict(raw, source=self.source)

    def round_cap(self) -> int:
        return self.config([]).training.rounds

    @property
    def pilot_labels(self) -> dict[str, list[str]]:
        """The pilot's jobs: the fixed rules and FSLoRA; with `pilot_all_arms` every arm."""
        arms = self.arms if self.pilot_all_arms else {REFERENCE: self.arms[REFERENCE]}
        return {**self.fixed_rules, **arms}

    def step_key(self, overrides: Sequence[str]) -> str:
        """The step size the rule's grid scales for a run: the server optimizer's lr when the
        run has one (FSLoRA as its authors run it), else the clients' lr."""
        cfg = self.config([*overrides, "training.time_budget_s=100"])
        return "method.server_lr" if cfg.method.server_optimizer != "avg" else "training.lr"

    def step_value(self, overrides: Sequence[str]) -> float:
        cfg = self.config([*overrides, "training.time_budget_s=100"])
        section, key = self.step_key(overrides).split(".")
        return float(getattr(getattr(cfg, section), key))


def _number(study: dict, key: str, default: float, lo: float, lo_open: bool = False) -> float:
    value = study.get(key, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (value > lo if lo_open else value >= lo) or value != value:
        raise bad_value(f"study.{key}", value, f"a number {'>' if lo_open else '>='} {lo:g}")
    return float(value)


def _int(study: dict, key: str, default: int, lo: int) -> int:
    value = study.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise bad_value(f"study.{key}", value, f"an integer >= {lo}")
    return value


def _overrides(study: dict, key: str) -> dict[str, list[str]]:
    table = study.get(key)
    if not isinstance(table, dict) or not table:
        raise bad_value(f"study.{key}", table, "a table of label = [overrides] (non-empty)")
    for label, values in table.items():
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise bad_value(f"study.{key}.{label}", values, "a list of section.key=value strings")
    return {label: list(values) for label, values in table.items()}


def spec_from_dict(raw: dict[str, Any], source: str) -> StudySpec:
    """Check the `[study]` table of a study config (read as TOML) and every run's config."""
    # a renamed flat key moved to its table once here (one FutureWarning, not one per run)
    raw = copy.deepcopy(upgrade_renamed_keys(raw, source=source))
    study = raw.pop("study", None)
    if not isinstance(study, dict):
        raise ConfigError(f"{source}: no [study] table")
    unknown = [k for k in study if k not in STUDY_KEYS]
    if unknown:
        raise bad_value(f"study.{unknown[0]}", study[unknown[0]], "keys: " + ", ".join(STUDY_KEYS))
    seeds = study.get("seeds")
    if (
        not isinstance(seeds, list)
        or not seeds
        or len(set(seeds)) != len(seeds)
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds)
    ):
        raise bad_value("study.seeds", seeds, "a list of distinct integers >= 0")
    pilot_seed = _int(study, "pilot_seed", -1, 0)
    if pilot_seed in seeds:
        raise bad_value("study.pilot_seed", pilot_seed, f"a seed not among study.seeds {seeds}")
    protocol_fixed = study.get("protocol_fixed", False)
    if not isinstance(protocol_fixed, bool):
        raise bad_value("study.protocol_fixed", protocol_fixed, "true or false")
    secondary = study.get("secondary", [])
    if not isinstance(secondary, list):
        raise bad_value("study.secondary", secondary, "a list of TASK/FIELD metrics")
    fraction = _number(study, "target_fraction", 0.5, 0.0, lo_open=True)
    if fraction > 1:
        raise bad_value("study.target_fraction", fraction, "a number in (0, 1]")
    every_s = _number(study, "pilot_eval_every_s", 0.0, 0.0)
    every = _int(study, "pilot_eval_every", 0, 0)
    if not (every_s or every):
        raise bad_value(
            "study.pilot_eval_every_s",
            every_s,
            "> 0 (a time grid for the pilot's evaluations), or study.pilot_eval_every > 0 "
            "(a round grid): the pilot sets the budget, so its grid cannot derive from it",
        )
    arms = _overrides(study, "arms")
    fixed = _overrides(study, "fixed_rules")
    if REFERENCE not in arms:
        raise bad_value("study.arms", list(arms), f"a table with an arm {REFERENCE!r}")
    labels = [*arms, FIXED_BEST]
    baselines = study.get("baselines", [lab for lab in labels if not lab.startswith("proposed")])
    if not isinstance(baselines, list) or any(b not in labels for b in baselines) or not baselines:
        raise bad_value("study.baselines", baselines, "a list of arm labels: " + ", ".join(labels))
    v2 = _v2_fields(study, budget_s=_number(study, "budget_s", 0.0, 0.0))
    spec = StudySpec(
        protocol_fixed=protocol_fixed,
        seeds=tuple(seeds),
        pilot_seed=pilot_seed,
        metric=parse_metric(study.get("metric")),
        secondary=tuple(parse_metric(m, "study.secondary") for m in secondary),
        budget_s=_number(study, "budget_s", 0.0, 0.0),
        budget_round_s=_number(study, "budget_round_s", 10.0, 0.0),
        target_fraction=fraction,
        pilot_eval_every_s=every_s,
        pilot_eval_every=every,
        grid_points=_int(study, "grid_points", 10, 1),
        baselines=tuple(baselines),
        arms=arms,
        fixed_rules=fixed,
        raw=raw,
        source=source,
        **v2,
    )
    from fedlora.federation.methods.registry import check_method_config

    _check_grid_stop(spec)
    for overrides in [*arms.values(), *fixed.values()]:  # every run's config checks
        check_method_config(spec.config([*overrides, "training.time_budget_s=100"]))
    return spec


def _check_grid_stop(spec: StudySpec) -> None:
    """grid_stops_at_drop needs the metric to be what training.stop_accuracy_drop judges:
    the mean accuracy over data.eval_tasks, so the accuracy of the one evaluation task."""
    eval_tasks = list(spec.config(["training.time_budget_s=100"]).data.eval_tasks)
    if spec.grid_stops_at_drop and (spec.metric.field != "acc" or eval_tasks != [spec.metric.task]):
        raise bad_value(
            "study.grid_stops_at_drop",
            True,
            f"false unless study.metric is the accuracy of the one evaluation task (metric "
            f"{spec.metric.text}, data.eval_tasks {eval_tasks}): training.stop_accuracy_drop "
            "judges the mean accuracy over data.eval_tasks",
        )


def _v2_fields(study: dict, budget_s: float) -> dict[str, Any]:
    """The keys of protocol v2, checked (research/study_planner/study_planner_v2.md)."""
    out: dict[str, Any] = {
        "target_gain": _number(study, "target_gain", 0.0, 0.0),
        "hold_evals": _int(study, "hold_evals", 1, 1),
        "learn_min_gain": _number(study, "learn_min_gain", 0.0, 0.0),
        "learn_max_drop": _number(study, "learn_max_drop", math.inf, 0.0),
        "noninferiority_margin": _number(study, "noninferiority_margin", 0.0, 0.0),
    }
    pilot_all = study.get("pilot_all_arms", False)
    if not isinstance(pilot_all, bool):
        raise bad_value("study.pilot_all_arms", pilot_all, "true or false")
    if pilot_all and not budget_s:
        raise bad_value(
            "study.pilot_all_arms",
            pilot_all,
            "false unless study.budget_s > 0 (the pilot runs every arm to the budget)",
        )
    out["pilot_all_arms"] = pilot_all
    grid = study.get("step_grid", [])
    ok = isinstance(grid, list) and all(
        isinstance(g, (int, float)) and not isinstance(g, bool) and 0 < g < math.inf and g != 1
        for g in grid
    )
    if not ok or len(set(grid)) != len(grid):
        raise bad_value("study.step_grid", grid, "a list of distinct factors > 0, other than 1")
    if grid and not pilot_all:
        raise bad_value("study.step_grid", grid, "[] unless study.pilot_all_arms = true")
    out["step_grid"] = tuple(float(g) for g in grid)
    stops = study.get("grid_stops_at_drop", False)
    if not isinstance(stops, bool):
        raise bad_value("study.grid_stops_at_drop", stops, "true or false")
    if stops and not (grid and out["learn_max_drop"] < math.inf):
        raise bad_value(
            "study.grid_stops_at_drop",
            stops,
            "false unless study.step_grid and study.learn_max_drop are set (the drop it stops at)",
        )
    out["grid_stops_at_drop"] = stops
    return out


def chosen_names(flag: str, wanted: Sequence[str], allowed: list[str]) -> list[str]:
    """The subset `wanted` of `allowed` (all of them when empty); an unknown name is refused."""
    unknown = [w for w in wanted if w not in allowed]
    if unknown:
        raise ConfigError(f"{flag}: {', '.join(unknown)} unknown (allowed: {', '.join(allowed)})")
    return list(wanted) or allowed


def load_spec(path: str | Path) -> StudySpec:
    """Read and check a study config."""
    return spec_from_dict(read_toml(path), str(path))
