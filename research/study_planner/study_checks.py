"""The planner study's report reads only what belongs together: rule.json with the fields it
needs, the pilot's run directories it follows from (re-derived and compared), and analysed
runs that share one protocol apart from their arm's overrides, their seed and (protocol v2)
their arm's step. Anything else is refused with a `DataError` naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlora.errors import ConfigError, DataError
from fedlora.federation.rundir import saved_config_from_table
from fedlora.studies.runs import RunRecord, flat_config, load_run
from research.study_planner.study_rule import Metric, derive_rule, derive_rule_v2, metric_points
from research.study_planner.study_spec import REFERENCE

if TYPE_CHECKING:  # study_stats imports this module: its Cell is a name for the reader only
    from research.study_planner.study_stats import Cell


def check_rule_fields(rule: Any, path: str) -> dict[str, Any]:
    need = (
        "metric",
        "budget_s",
        "target_gain",
        "fixed_best",
        "seeds",
        "pilot_seed",
        "arms",
        "baselines",
        "proposed",
        "grid_s",
    )
    if not isinstance(rule, dict) or any(k not in rule for k in need):
        raise DataError(f"{path}: not a study rule (keys {', '.join(need)})")
    return rule


# the sections every analysed run shares, apart from its arm's own overrides and its seed
SHARED_SECTIONS = ("model", "lora", "data", "network", "training", "evaluation")
STEP_KEYS = ("training.lr", "method.server_lr")


def resolved_shared(conf: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The shared sections of a run's config as the run ran them, as dotted keys: a study spans
    sessions, and a key added to fedlora's config since an earlier run is absent from that
    run's config.toml; it ran with the key's legacy value or default (`load_saved_config`),
    which is what is compared."""
    try:
        resolved = saved_config_from_table(conf, source=str(run_dir / "config.toml")).to_dict()
    except ConfigError as e:
        raise DataError(f"{run_dir}: not a fedlora run's config: {e}") from None
    return flat_config({sec: resolved[sec] for sec in SHARED_SECTIONS})


def check_same_protocol(cells: dict[str, list[Cell]], rule: dict[str, Any]) -> None:
    """Refuse a run whose config differs from the others' beyond its arm's overrides (a
    config.toml edited by hand: an lr of 5.0): the shared sections must be equal once the
    keys any arm overrides and training.seed are set aside; under protocol v2 each run's step
    must be its arm's step in rule.json."""
    own = {o.split("=", 1)[0].strip() for ovs in rule.get("overrides", {}).values() for o in ovs}
    own.add("training.seed")
    steps = rule.get("step_values")
    if steps:
        own.update(STEP_KEYS)
    first: tuple[str, dict] | None = None
    for arm, row in cells.items():
        label = rule["fixed_best"] if arm == "fixed-best" else arm
        for c in row:
            conf = c.run.config
            if not conf:  # no config.toml: nothing to compare
                continue
            flat = {
                key: value
                for key, value in resolved_shared(conf, c.run.path).items()
                if key not in own and not any(key.startswith(o + ".") for o in own)
            }
            if first is None:
                first = (c.run.path.name, flat)
            diff = sorted(k for k in set(flat) | set(first[1]) if flat.get(k) != first[1].get(k))
            if diff:
                raise DataError(
                    f"{c.run.path}: its config differs from {first[0]}'s at {diff[0]} "
                    f"({flat.get(diff[0])!r} vs {first[1].get(diff[0])!r}), which no arm "
                    "overrides: not a run of this study"
                )
            if steps and label in steps:
                key = rule["step_keys"][label]
                sec, name = key.split(".")
                value = (conf.get(sec) or {}).get(name)
                if value is None or abs(float(value) - steps[label]) > 1e-12 * steps[label]:
                    raise DataError(
                        f"{c.run.path}: {key} = {value!r}, but rule.json gives {arm} the step "
                        f"{steps[label]!r}: not a run of this study"
                    )


def check_pilot(out: Path, rule: dict[str, Any], metric: Metric) -> dict[str, RunRecord]:
    """The pilot's runs, and the rule re-derived from them: a rule.json that does not follow
    from the pilot's run directories is refused."""
    pilot_dir = out / "pilot"
    if "steps" in rule:
        return check_pilot_v2(out, rule, metric)
    runs = {}
    for d in sorted(pilot_dir.glob(f"*-seed{rule['pilot_seed']}")):
        runs[d.name.rsplit("-seed", 1)[0]] = load_run(d)
    fixed = [lab for lab in rule.get("fixed_order", []) if lab in runs]
    if not runs or REFERENCE not in runs or not fixed:
        raise DataError(f"{pilot_dir}: the pilot's runs are missing")
    pts = {lab: metric_points(r, metric) for lab, r in runs.items()}
    again = derive_rule(pts, metric, rule["budget_s"], rule["target_fraction"], fixed)
    same = abs(again["target_gain"] - rule["target_gain"]) <= 1e-9 * max(1, rule["target_gain"])
    if not same or again["fixed_best"] != rule["fixed_best"]:
        raise DataError(
            f"{out / 'rule.json'} does not follow from the pilot's runs (target gain "
            f"{rule['target_gain']:.6g} vs {again['target_gain']:.6g}, fixed-best "
            f"{rule['fixed_best']} vs {again['fixed_best']})"
        )
    return runs


def pilot_label(name: str, rule: dict[str, Any]) -> tuple[str, float]:
    """(label, step factor) of a protocol-v2 pilot run name without its seed:
    `fslora-x0.3` -> ("fslora", 0.3) when fslora is one of the rule's labels."""
    head, sep, tail = name.rpartition("-x")
    if sep and head in rule["steps"]:
        return head, float(tail)
    return name, 1.0


def check_pilot_v2(out: Path, rule: dict[str, Any], metric: Metric) -> dict[str, RunRecord]:
    """Protocol v2: the pilot's runs (`<label>[-x<factor>]-seed<pilot>`), and each arm's step,
    whether it learned and fixed-best re-derived from them; a rule.json that does not follow
    is refused. Returns {run name: run}, with the pilot directories of labels rule.json has no
    step for (arms an amendment took out before the rule was written) among them: reported,
    never part of the rule (`pilot_label`)."""
    suffix = f"-seed{rule['pilot_seed']}"
    runs = {d.name[: -len(suffix)]: load_run(d) for d in sorted((out / "pilot").glob("*" + suffix))}
    pilot: dict[str, dict[float, list]] = {}
    for name, run in runs.items():
        label, factor = pilot_label(name, rule)
        if label in rule["steps"]:
            pilot.setdefault(label, {})[factor] = metric_points(run, metric)
    if set(pilot) != set(rule["steps"]):
        raise DataError(f"{out / 'pilot'}: the pilot's runs are not those of rule.json's steps")
    again = derive_rule_v2(
        pilot,
        metric,
        rule["budget_s"],
        rule["target_gain"],
        int(rule["hold_evals"]),
        rule["fixed_order"],
        rule["learn_min_gain"],
        rule["learn_max_drop"],
    )
    for key in ("steps", "fixed_best"):
        if again[key] != rule[key]:
            raise DataError(
                f"{out / 'rule.json'} does not follow from the pilot's runs ({key}: "
                f"{rule[key]} vs {again[key]})"
            )
    return runs
