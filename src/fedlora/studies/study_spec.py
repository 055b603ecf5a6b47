"""The planner study's config (configs/study_planner.toml): its `[study]` table, checked, and
the experiment sections every run starts from. The arms and fixed sampling rules are tables
of `section.key=value` overrides (`[study.arms]`, `[study.fixed_rules]`), so a tiny config
(the tests') runs the same stages with other arms.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlora.config.experiment import ExperimentConfig, config_from_dict
from fedlora.config.toml_io import apply_overrides, read_toml
from fedlora.errors import ConfigError, bad_value
from fedlora.studies.study_rule import Metric, parse_metric

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
    source: str = "configs/study_planner.toml"

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
    raw = copy.deepcopy(raw)
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
    )
    from fedlora.federation.methods.registry import check_method_config

    for overrides in [*arms.values(), *fixed.values()]:  # every run's config checks
        check_method_config(spec.config([*overrides, "training.time_budget_s=100"]))
    return spec


def load_spec(path: str | Path) -> StudySpec:
    """Read and check a study config."""
    return spec_from_dict(read_toml(path), str(path))
