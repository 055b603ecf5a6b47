"""Protocol v2's rule for the planner study (docs/study_planner_v2.md): a crossing that
holds, the learning criterion, the step-size grid and the pilot that runs it, with
hand-computed values and a fake run function that writes chosen curves."""

from __future__ import annotations

import json

import pytest
import tomllib

from fedlora.errors import ConfigError
from fedlora.studies import study_rule as sr
from fedlora.studies.study_runner import pilot_stage, run_stage
from fedlora.studies.study_spec import spec_from_dict
from study_tiny import TINY_STUDY

ACC = sr.parse_metric("arc-e/acc")
V2_KEYS = """
budget_s = 6.0
target_gain = 0.03
hold_evals = 2
pilot_all_arms = true
learn_min_gain = 0.02
learn_max_drop = 0.05
step_grid = [0.3, 3.0]
noninferiority_margin = 0.02
"""


def v2_spec():
    text = TINY_STUDY.replace('metric = "arc-e/loss"', 'metric = "arc-e/acc"' + V2_KEYS)
    return spec_from_dict(tomllib.loads(text), "tiny-v2")


def test_held_crossing_needs_consecutive_evaluations_within_the_budget():
    # round 0 at 0.50; +3 points is 0.53
    points = [(0, 0.50), (1, 0.54), (2, 0.52), (3, 0.53), (4, 0.56), (5, 0.58)]
    assert sr.time_to_target_held(points, ACC, 0.03, 10, hold=1) == (1, True)
    assert sr.time_to_target_held(points, ACC, 0.03, 10, hold=2) == (3, True)
    assert sr.time_to_target_held(points, ACC, 0.03, 10, hold=3) == (3, True)
    # the evaluation at the round that spends B (t = 4.2 >= B = 4) is the window's last:
    # with hold 2, a crossing at 3 that holds at 4.2 counts; one at 4.2 alone does not
    late = [(0, 0.50), (2, 0.51), (3, 0.53), (4.2, 0.55), (5, 0.60)]
    assert sr.time_to_target_held(late, ACC, 0.03, 4, hold=2) == (3, True)
    alone = [(0, 0.50), (2, 0.51), (3, 0.52), (4.2, 0.55), (5, 0.60)]
    assert sr.time_to_target_held(alone, ACC, 0.03, 4, hold=2) == (4, False)
    # a loss falls: the gain of mc_loss is start - value
    loss = sr.parse_metric("arc-e/mc_loss")
    assert sr.time_to_target_held([(0, 2.0), (1, 1.9), (2, 1.95)], loss, 0.04, 3, 2) == (1, True)


def test_learning_criterion_and_step_choice_by_hand():
    up = [(0, 0.50), (3, 0.51), (6, 0.525)]  # +2.5 at B, never below
    flat = [(0, 0.50), (3, 0.51), (6, 0.51)]  # +1 at B
    dip = [(0, 0.50), (3, 0.44), (6, 0.56)]  # +6 at B, but 6 points below round 0 once
    assert sr.learning(up, ACC, 6, 0.02, 0.05) == sr.Learning(True, pytest.approx(0.025), 0)
    assert not sr.learning(flat, ACC, 6, 0.02, 0.05).learned
    got = sr.learning(dip, ACC, 6, 0.02, 0.05)
    assert not got.learned and got.worst_drop == pytest.approx(0.06)
    # the protocol's step learns: kept, whatever the grid shows
    assert sr.choose_step({1.0: up, 3.0: dip}, ACC, 6, 0.02, 0.05) == (1.0, True)
    more = [(0, 0.50), (3, 0.52), (6, 0.55)]
    assert sr.choose_step({1.0: flat, 0.3: up, 3.0: more}, ACC, 6, 0.02, 0.05) == (3.0, True)
    assert sr.choose_step({1.0: flat, 0.3: flat, 3.0: dip}, ACC, 6, 0.02, 0.05) == (1.0, False)
    # ties in the gain: the factor nearest 1 (0.3 is |ln| 1.20 from it, 3 is 1.10)
    assert sr.choose_step({1.0: flat, 0.3: up, 3.0: up}, ACC, 6, 0.02, 0.05) == (3.0, True)


def test_rule_v2_picks_fixed_best_at_its_chosen_step_with_the_config_target():
    pilot = {
        "fixed-a": {1.0: [(0, 0.5), (2, 0.54), (4, 0.55), (6, 0.56)]},  # held from 2
        "fixed-b": {
            1.0: [(0, 0.5), (2, 0.5), (4, 0.5), (6, 0.5)],  # does not learn
            3.0: [(0, 0.5), (1, 0.54), (2, 0.55), (6, 0.57)],  # learns, held from 1
        },
        "fslora": {1.0: [(0, 0.5), (2, 0.5), (4, 0.5), (6, 0.5)]},
    }
    rule = sr.derive_rule_v2(pilot, ACC, 6, 0.03, 2, ["fixed-a", "fixed-b"], 0.02, 0.05)
    assert rule["steps"] == {"fixed-a": 1.0, "fixed-b": 3.0, "fslora": 1.0}
    assert rule["fixed_best"] == "fixed-b" and rule["fixed_order"] == ["fixed-b", "fixed-a"]
    assert rule["target_gain"] == 0.03
    assert rule["pilot_times_s"]["fslora"] == [6, False, False]
    assert rule["learning"]["fixed-b"]["3"]["learned"] is True


def test_v2_keys_are_checked():
    raw = tomllib.loads(TINY_STUDY.replace('metric = "arc-e/loss"', 'metric = "arc-e/acc"'))
    for key, value, match in [
        ("step_grid", [1.0], "other than 1"),
        ("step_grid", [0.0], "factors > 0"),
        ("step_grid", [3.0], r"\[\] unless study.pilot_all_arms"),
        ("pilot_all_arms", True, "unless study.budget_s > 0"),
        ("hold_evals", 0, "an integer >= 1"),
        ("learn_max_drop", -1, ">= 0"),
    ]:
        bad = {**raw, "study": {**raw["study"], key: value}}
        with pytest.raises(ConfigError, match=match):
            spec_from_dict(bad, "tiny")


def fake_runs(curves):
    """A run function that writes the curve chosen by (label, step) for each run."""
    calls = []

    def fake(cfg, run_dir, *, resume):
        calls.append((run_dir.name, cfg.training.lr, cfg.training.time_budget_s))
        label = run_dir.name.rsplit("-seed", 1)[0]
        run_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            {"round": r, "sim_time_s": t, "eval": {"arc-e": v}}
            for r, (t, v) in enumerate(curves(label, cfg.training.lr))
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        (run_dir / "config.toml").write_text("")
        (run_dir / "summary.json").write_text(json.dumps({"sim_time_s": 6.0, "rounds": 3}))
        return {}

    return fake, calls


def test_pilot_v2_runs_every_arm_then_the_grid_for_those_that_do_not_learn(tmp_path):
    spec = v2_spec()
    lr = spec.config([]).training.lr  # the tiny config's 0.05

    def curves(label, run_lr):
        learns = [(0, 0.5), (2, 0.54), (4, 0.55), (6, 0.56)]
        flat = [(0, 0.5), (2, 0.5), (4, 0.5), (6, 0.5)]
        if label.startswith("fixed-0.5"):  # learns only at 3x the step
            return learns if run_lr == pytest.approx(3 * lr) else flat
        return learns

    fake, calls = fake_runs(curves)
    rule = pilot_stage(spec, tmp_path, run_fn=fake, log=print)
    names = [c[0] for c in calls]
    assert names[:4] == [
        "fixed-full-seed5",
        "fixed-0.5-seed5",
        "fslora-seed5",
        "proposed-separate-seed5",
    ]  # every arm, not only FSLoRA
    assert sorted(names[4:]) == ["fixed-0.5-x0.3-seed5", "fixed-0.5-x3-seed5"]
    assert all(c[2] == 6.0 for c in calls)  # the pilot runs to B, as an analysed run
    assert rule["steps"]["fixed-0.5"] == 3.0 and rule["steps"]["fixed-full"] == 1.0
    assert rule["step_values"]["fixed-0.5"] == pytest.approx(3 * lr)
    assert rule["fixed_best"] == "fixed-full"  # both held from t = 2; full first in order
    # the analysed fixed-best and arms carry their chosen step
    rule["fixed_best"] = "fixed-0.5"
    (tmp_path / "rule.json").write_text(json.dumps(rule))
    calls.clear()
    run_stage(spec, tmp_path, run_fn=fake, log=print, seeds=[0])
    lrs = {name: run_lr for name, run_lr, _ in calls}
    assert lrs["fixed-best-seed0"] == pytest.approx(3 * lr) and lrs["fslora-seed0"] == lr


def test_run_stage_refuses_a_fixed_best_the_config_does_not_have(tmp_path):
    spec = v2_spec()
    (tmp_path / "rule.json").write_text(
        json.dumps({"budget_s": 6.0, "grid_s": 0.6, "fixed_best": "fixed-nope"})
    )
    with pytest.raises(ConfigError, match="fixed_best 'fixed-nope' is not a fixed rule"):
        run_stage(spec, tmp_path, run_fn=fake_runs(lambda *a: [])[0], log=print)
