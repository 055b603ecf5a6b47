"""Targets by rule (fedlora.studies.target_rule): the slowest baseline at a fraction of the
budget, the majority floor, targets.toml and bad rules."""

from __future__ import annotations

import math

import pytest

from fedlora.errors import ConfigError
from fedlora.studies import target_rule
from fedlora.studies.runs import load_run, time_to
from powered_cases import write_run

RULE = {"budget_fraction": 0.6, "floor_se": 4, "text": "slowest baseline at 60%, floor 4 SE"}


def test_rule_targets_slowest_baseline_at_the_fraction_with_the_majority_floor(tmp_path):
    # at 0.6 × 100 s = 60 s: fslora 0.40 (its 70 s point is later), heterolora 0.30 ->
    # slowest 0.30; floor 0.28 + 4·√(0.28·0.72/500) = 0.36032 > 0.30 -> 0.36032.
    # eval_loss at 60 s: 1.1 and 1.3 -> 1.3. proposed is not a baseline (its 0.20 is ignored).
    runs = [
        write_run(tmp_path, "fslora", 9, [(0, 0.25, 1.5), (50, 0.40, 1.1), (70, 0.5, 1.0)]),
        write_run(tmp_path, "heterolora", 9, [(0, 0.25, 1.5), (30, 0.30, 1.3), (65, 0.45, 1)]),
        write_run(tmp_path, "proposed", 9, [(0, 0.25, 1.5), (40, 0.20, 2.0)]),
    ]
    result = target_rule.rule_targets([load_run(r) for r in runs], ["arc-e"], 100.0, RULE)
    floor = 0.28 + 4 * math.sqrt(0.28 * 0.72 / 500)
    assert result["accuracy"] == {"arc-e": pytest.approx(floor)}
    assert result["loss"] == {"arc-e": 1.3}
    d = result["details"]["arc-e"]
    assert d["slowest"] == "heterolora" and d["floored"] and d["at_s"] == 60.0
    assert d["accuracy_at"] == {"fslora": 0.40, "heterolora": 0.30}
    # without the floor the slowest baseline's level is the target
    no_floor = target_rule.rule_targets([load_run(r) for r in runs], ["arc-e"], 100.0,
                                    {**RULE, "floor_se": 0})  # fmt: skip
    assert no_floor["accuracy"] == {"arc-e": 0.30}
    text = target_rule.targets_toml(result, target_rule.check_rule(RULE), "pilot")
    import tomllib

    parsed = tomllib.loads(text)
    assert parsed["targets"]["arc-e"] == pytest.approx(floor)
    assert parsed["target_losses"]["arc-e"] == 1.3 and parsed["rule"] == RULE["text"]


@pytest.mark.parametrize(
    "rule, message",
    [
        ({"budget_fraction": 0, "text": "x"}, "budget_fraction"),
        ({"budget_fraction": 1.5, "text": "x"}, "budget_fraction"),
        ({"budget_fraction": 0.6, "floor_se": -1, "text": "x"}, "floor_se"),
        ({"budget_fraction": 0.6}, r"target_rule.text"),
        ({"budget_fraction": 0.6, "text": "x", "extra": 1}, r"target_rule.extra"),
        ("0.6", "a table"),
    ],
)
def test_check_rule_bad_input(rule, message):
    with pytest.raises(ConfigError, match=message):
        target_rule.check_rule(rule)


def test_rule_targets_bad_input(tmp_path):
    run = load_run(write_run(tmp_path, "fslora", 1, [(0, 0.25, 1.5)]))
    with pytest.raises(ConfigError, match="time_budget_s"):
        target_rule.rule_targets([run], ["arc-e"], 0.0, RULE)
    with pytest.raises(ConfigError, match="no pilot baseline evaluated 'obqa'"):
        target_rule.rule_targets([run], ["obqa"], 10.0, RULE)
    prop = load_run(write_run(tmp_path, "proposed", 1, [(0, 0.25, 1.5)]))
    with pytest.raises(ConfigError, match="no baseline run"):
        target_rule.rule_targets([prop], ["arc-e"], 10.0, RULE)


def test_loss_drops_map_the_pilot_target_to_a_decrease_from_round_0(tmp_path):
    # Prepare: two pilot runs with round-0 eval_loss 1.5 (same questions); target 1.3 -> Δ 0.2
    pilot = [
        load_run(write_run(tmp_path / "pilot", "fslora", 9, [(0, 0.25, 1.5), (50, 0.3, 1.1)])),
        load_run(write_run(tmp_path / "pilot", "heterolora", 9, [(0, 0.25, 1.5), (30, 0.3, 1.3)])),
    ]
    # Execute
    drops = target_rule.loss_drops(pilot, {"arc-e": 1.3, "obqa": 1.0})
    # Assert: obqa has no pilot evaluation: left out; a target above round 0 (Δ <= 0) too
    assert drops == {"arc-e": pytest.approx(0.2)}
    assert target_rule.loss_drops(pilot, {"arc-e": 1.6}) == {}
    # a main seed whose questions start at 1.25, already below the absolute 1.3 at round 0:
    # the absolute target is "reached" at 0 s, the decrease of 0.2 (<= 1.05) only at 40 s
    main = load_run(write_run(tmp_path, "fslora", 1, [(0, 0.25, 1.25), (20, 0.3, 1.1),
                                                      (40, 0.3, 1.05)]))  # fmt: skip
    assert time_to(main, "arc-e", "loss", 1.3) == (0.0, True)
    assert time_to(main, "arc-e", "loss_drop", drops["arc-e"]) == (40.0, True)
    assert time_to(main, "arc-e", "loss_drop", 0.5) == (40.0, False)  # censored at its clock
