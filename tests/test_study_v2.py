"""Protocol v2's rule for the planner study (research/study_planner/study_planner_v2.md): a crossing that
holds, the learning criterion, the step-size grid and the pilot that runs it, with
hand-computed values and a fake run function that writes chosen curves."""

from __future__ import annotations

import json
import math

import pytest
import tomllib

from fedlora.errors import ConfigError
from research.study_planner import study_rule as sr
from research.study_planner.study_runner import pilot_stage, run_stage
from research.study_planner.study_spec import spec_from_dict
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


def _write_run(root, name, evals, correct=None):
    run = root / name
    run.mkdir(parents=True)
    lines = [{"round": r, "sim_time_s": t, "eval": {"arc-e": v}} for r, (t, v) in enumerate(evals)]
    # the scores that need no model, as the engine logs them with every evaluation
    lines[0].update(eval_n={"arc-e": 10}, eval_chance={"arc-e": 0.25}, eval_majority={"arc-e": 0.3})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    seed = int(name.rsplit("seed", 1)[1])
    summary = {"method": name.split("-")[0], "seed": seed, "stop_reason": "time_budget"}
    (run / "summary.json").write_text(json.dumps(summary))
    if correct is not None:
        pred = {"round": len(evals) - 1, "task": "arc-e", "ids": [f"q{i}" for i in range(10)]}
        (run / "predictions.jsonl").write_text(json.dumps({**pred, "correct": correct}) + "\n")


def _study_v2(root):
    """A finished v2 study on hand-made runs: B = 60 s, target +0.03 held twice, margin 0.02."""
    up = [(0, 0.5), (6, 0.54), (12, 0.55), (60.5, 0.56)]  # held from 6 s
    flat = [(0, 0.5), (6, 0.5), (12, 0.5), (60.5, 0.5)]
    pilot = {
        "fixed-a": {1.0: up},
        "fixed-b": {1.0: flat, 3.0: [(0, 0.5), (6, 0.5), (12, 0.53), (60.5, 0.54)]},
        "fslora": {1.0: flat, 3.0: flat},
        "fslora-paper": {1.0: up},
        "proposed-inrun": {1.0: up},
    }
    for lab, trials in pilot.items():
        for f, ev in trials.items():
            _write_run(root / "pilot", f"{lab}{'' if f == 1 else f'-x{f:g}'}-seed9", ev)
    rule = sr.derive_rule_v2(pilot, ACC, 60.0, 0.03, 2, ["fixed-a", "fixed-b"], 0.02, 0.05)
    rule.update(
        seeds=[0, 1, 2],
        pilot_seed=9,
        arms=["fslora", "fslora-paper", "proposed-inrun", "fixed-best"],
        baselines=["fslora", "fslora-paper", "fixed-best"],
        proposed=["proposed-inrun"],
        grid_s=6.0,
        secondary=[],
        noninferiority_margin=0.02,
        step_keys={lab: "training.lr" for lab in pilot},
        step_values={lab: 1e-3 * f for lab, f in rule["steps"].items()},
        budget_from_config=True,
    )
    (root / "rule.json").write_text(json.dumps(rule))
    # (time of a held crossing or None, questions right of 10 at B) per seed
    runs = {
        "fslora": [(None, 6), (None, 6), (None, 6)],
        "fslora-paper": [(24, 7), (30, 6), (24, 7)],
        "fixed-best": [(12, 7), (12, 7), (18, 7)],
        "proposed-inrun": [(6, 8), (6, 7), (6, 8)],
    }
    for lab, row in runs.items():
        for seed, (t, right) in enumerate(row):
            if t is None:  # one evaluation at the target only: it does not hold
                ev = [(0, 0.5), (6, 0.53), (12, 0.52), (60.5, right / 10)]
            else:
                ev = [(0, 0.5), (t, 0.54), (t + 3, 0.55), (60.5, right / 10)]
            _write_run(root, f"{lab}-seed{seed}", ev, correct=[1] * right + [0] * (10 - right))
    return root


def test_v2_report_hand_checked(tmp_path):
    from scipy import stats

    from research.study_planner.study_report import write_study_report

    out = _study_v2(tmp_path)
    # a pilot run of an arm an amendment took out before rule.json: listed, not in the rule
    _write_run(out / "pilot", "gone-arm-seed9", [(0, 0.5), (6, 0.5)])
    text = write_study_report(out).read_text()
    lines = text.splitlines()
    assert "never part of the rule): gone-arm." in text
    # every pilot run's curve, drawn beside the report and shown in its pilot section
    assert "![every pilot run's arc-e/acc, a panel per arm](pilot_curves.png)" in text
    assert (out / "pilot_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "- evaluation: 10 questions of arc-e; chance 25.0, most-frequent label 30.0 (%)" in text
    # the comparisons' table is one block: its rows follow the header, the per-seed list after
    at = lines.index("|---|---|---|---|---|---|---|---|---|")
    assert lines[at + 1].startswith("| proposed-inrun | fslora |")
    assert lines[at + 3].startswith("| proposed-inrun | fixed-best")
    assert lines[at + 4] == "" and lines[at + 5].startswith("Each seed's exact McNemar")
    # every pilot run's own held time, grid runs too: fixed-b x3 holds from 12 s = 0.20 min
    assert "| fixed-b-x3 | 0.20 | True | 4 |" in text
    assert "| fslora-x3 | 1.00 | False | 4 |" in text
    # not worse than fslora: +20, +10, +20 points, lower end 16.67 - 14.34 = +2.3 > -2: held
    assert (
        "| proposed-inrun is not worse than fslora at the budget (the paired 95% t interval "
        "above -2 points) | **held** |" in text
    )
    # fslora's seeds touch the target once (6 s) and fall back: censored at B = 1 min
    assert "| fslora | >= 1.00 (not reached) | >= 1.00 (not reached) |" in text
    assert "| proposed-inrun | 0.10 | 0.10 | 0.10 | 0.10 |" in text
    # proposed / fixed-best per seed 6/12, 6/12, 6/18: logs -ln2, -ln2, -ln3
    logs = [-math.log(2), -math.log(2), -math.log(3)]
    m = sum(logs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 2)
    half = stats.t.ppf(0.975, 2) * sd / math.sqrt(3)
    row = next(x for x in lines if x.startswith("| proposed-inrun | fixed-best"))
    assert f"{math.exp(m):.3f} [{math.exp(m - half):.3f}, {math.exp(m + half):.3f}]" in row
    # accuracy at B, proposed − fixed-best: +10, 0, +10 points; mean 6.67, sd 5.77
    d = [10.0, 0.0, 10.0]
    dm, dsd = sum(d) / 3, math.sqrt(sum((x - sum(d) / 3) ** 2 for x in d) / 2)
    dh = stats.t.ppf(0.975, 2) * dsd / math.sqrt(3)
    assert f"{dm:+.2f} [{dm - dh:+.2f}, {dm + dh:+.2f}]" in row
    # lower end -7.7 < -2: "not worse" is inconclusive, so "pays for its planning" too
    assert (
        "(sooner than the best baseline fixed-best, and not worse at the budget) | "
        "**inconclusive** |" in text
    )
    # per seed McNemar, never pooled: seed 0 has 1 question only proposed right: p = 1
    assert "- proposed-inrun vs fixed-best: 1/0 of 10, p 1; 0/0 of 10, p 1; 1/0 of 10, p 1" in text
    # both FSLoRA claims are judged; the authors' FSLoRA is censored on every seed, so
    # "not held" cannot be said and "held" needs more than 2.8x with Holm p < 0.05
    assert "sooner than FSLoRA as the paper describes it (plain averaging) |" in text
    assert "- step of fixed-b: training.lr = 0.003 (x3 the protocol's; learned" in text
    assert "- step of fslora: training.lr = 0.001 (x1 the protocol's; did NOT learn" in text
    assert "| fixed-b | x3 | +4.00 | 0.00 | True |" in text
    assert "fixed-best = fixed-a" in text  # held at 6 s against fixed-b's 12 s
    # a rule.json whose steps do not follow from the pilot's runs is refused
    rule = json.loads((out / "rule.json").read_text())
    (out / "rule.json").write_text(json.dumps({**rule, "steps": {**rule["steps"], "fixed-b": 1.0}}))
    with pytest.raises(Exception, match="does not follow from the pilot"):
        write_study_report(out)


def test_not_worse_by_margin_by_hand():
    from fedlora.studies.seeds import PairedDiff
    from research.study_planner.study_stats import not_worse_by_margin

    assert not_worse_by_margin(PairedDiff(0.01, 0.02, None, 3), 0.02, True) == sr.HELD
    assert not_worse_by_margin(PairedDiff(-0.05, 0.02, None, 3), 0.02, True) == sr.NOT_HELD
    assert not_worse_by_margin(PairedDiff(-0.01, 0.02, None, 3), 0.02, True) == sr.INCONCLUSIVE
    # a loss: lower is better, so +0.05 is worse by 0.05
    assert not_worse_by_margin(PairedDiff(0.05, 0.02, None, 3), 0.02, False) == sr.NOT_HELD
    assert not_worse_by_margin(PairedDiff(0.0, None, None, 1), 0.02, True) == sr.INCONCLUSIVE


def _learns_at(factor_of_label):
    """A run function: each label learns only at its step factor (x1 unless given), and
    writes the lr it ran at into config.toml (what the step check reads)."""
    base = v2_spec().config([]).training.lr
    calls = []

    def fake(cfg, run_dir, *, resume):
        label = run_dir.name.rsplit("-seed", 1)[0].split("-x")[0]
        calls.append(run_dir.name)
        ok = cfg.training.lr == pytest.approx(factor_of_label.get(label, 1.0) * base)
        curve = [(0, 0.5), (2, 0.54), (4, 0.55), (6, 0.56)] if ok else [(0, 0.5), (6, 0.5)]
        run_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            {"round": r, "sim_time_s": t, "eval": {"arc-e": v}} for r, (t, v) in enumerate(curve)
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        (run_dir / "config.toml").write_text(f"[training]\nlr = {cfg.training.lr!r}\n")
        (run_dir / "summary.json").write_text(json.dumps({"sim_time_s": 6.0, "rounds": 3}))
        return {}

    return fake, calls, base


def test_an_arm_whose_pilot_finished_runs_before_rule_json_at_the_step_the_rule_gives(tmp_path):
    spec = v2_spec()
    fake, calls, lr = _learns_at({"fslora": 3.0})  # fslora learns only at 3x the step
    assert pilot_stage(spec, tmp_path, run_fn=fake, log=print, only=["fslora"]) is None
    assert not (tmp_path / "rule.json").exists()  # the other arms' pilots have not run
    with pytest.raises(ConfigError, match="name with --arms"):
        run_stage(spec, tmp_path, run_fn=fake, log=print)
    with pytest.raises(ConfigError, match="fixed-best: it waits for"):
        run_stage(spec, tmp_path, run_fn=fake, log=print, arms_only=["fixed-best"])
    with pytest.raises(ConfigError, match=r"proposed-separate: .*x1 have not finished"):
        run_stage(spec, tmp_path, run_fn=fake, log=print, arms_only=["proposed-separate"])
    calls.clear()
    run_stage(spec, tmp_path, run_fn=fake, log=print, arms_only=["fslora"], seeds=[0])
    assert calls == ["fslora-seed0"]
    saved = tomllib.loads((tmp_path / "fslora-seed0" / "config.toml").read_text())
    assert saved["training"]["lr"] == pytest.approx(3 * lr)
    # the rest of the pilot: rule.json gives fslora the same factor, so its run is kept
    rule = pilot_stage(spec, tmp_path, run_fn=fake, log=print)
    assert rule["steps"]["fslora"] == 3.0
    calls.clear()
    out = run_stage(spec, tmp_path, run_fn=fake, log=print, seeds=[0])
    assert "fslora-seed0" not in calls and out[0] == "skipped"
    # a run saved under another step than the rule's is refused, naming the key and values
    (tmp_path / "fslora-seed1").mkdir()
    (tmp_path / "fslora-seed1" / "config.toml").write_text(f"[training]\nlr = {lr!r}\n")
    with pytest.raises(ConfigError, match=r"fslora-seed1/config.toml: training.lr = 0.05"):
        run_stage(spec, tmp_path, run_fn=fake, log=print, seeds=[1])


def test_same_protocol_compares_the_configs_as_the_runs_ran_them(tmp_path):
    # a study spans sessions: a table fedlora's config gained since an earlier run (data.mc)
    # is absent from that run's config.toml, and the run ran with its defaults, so the table
    # at its defaults is no difference, and at another value is one, named by its dotted key;
    # a key whose default changed (evaluation.format, LEGACY_DEFAULTS) is compared at the
    # value the older run ran with, which comparing only the keys both files hold would miss
    from types import SimpleNamespace as NS

    from fedlora.errors import DataError
    from research.study_planner.study_checks import check_same_protocol

    old = {"training": {"lr": 1e-3, "seed": 0}, "data": {"n_clients": 10}}
    new = {
        "training": {"lr": 1e-3, "seed": 1},
        "data": {"n_clients": 10, "mc": {"task": "mine"}},
        "evaluation": {"format": "llm-adapters"},
    }
    other = {**new, "data": {"n_clients": 10, "mc": {"task": "b"}}}
    harness = {**new, "evaluation": {"format": "harness"}}

    def cells(*configs):
        return {
            "arm": [
                NS(run=NS(config=c, path=tmp_path / f"arm-seed{i}")) for i, c in enumerate(configs)
            ]
        }

    rule = {"overrides": {}, "fixed_best": "fixed-a"}
    check_same_protocol(cells(old, new, {}), rule)  # {}: no config.toml, nothing compared
    with pytest.raises(
        DataError, match=r"arm-seed1: its config differs from arm-seed0's at data.mc.task"
    ):
        check_same_protocol(cells(new, other), rule)
    with pytest.raises(DataError, match=r"at evaluation.format \('harness' vs 'llm-adapters'\)"):
        check_same_protocol(cells(old, harness), rule)
    with pytest.raises(DataError, match=r"at data.n_clients \(12 vs 10\)"):
        check_same_protocol(cells(old, {**old, "data": {"n_clients": 12}}), rule)
    with pytest.raises(DataError, match=r"arm-seed1: not a fedlora run's config: .*n_clients"):
        check_same_protocol(cells(old, {**old, "data": {"n_clients": "ten"}}), rule)
    assert old == {"training": {"lr": 1e-3, "seed": 0}, "data": {"n_clients": 10}}  # unchanged


def test_report_pilot_figure_draws_the_rules_arms_only(tmp_path, monkeypatch):
    # the pilot runs of rule.json's arms, a panel each in its order, grid runs as lines;
    # a pilot directory of an arm an amendment took out is not drawn
    from research.study_planner import study_figures
    from research.study_planner.study_checks import check_pilot_v2

    out = _study_v2(tmp_path)
    _write_run(out / "pilot", "gone-arm-seed9", [(0, 0.5), (6, 0.5)])
    rule = json.loads((out / "rule.json").read_text())
    pilot = check_pilot_v2(out, rule, ACC)
    drawn = {}

    def keep(fig, path, *, axes=(), title=""):
        drawn.update(fig=fig, axes=list(axes), path=path)
        return path

    monkeypatch.setattr(study_figures, "save_figure", keep)
    assert study_figures.pilot_figure_of_rule(out, rule, ACC, pilot) == out / "pilot_curves.png"
    shown = [ax for ax in drawn["fig"].axes if ax not in drawn["axes"]]
    assert [ax.get_title() for ax in shown] == list(rule["steps"])
    runs = {
        ax.get_title(): [ln.get_label() for ln in ax.get_lines() if ln.get_marker() == "."]
        for ax in shown
    }
    assert runs["fixed-b"] == ["x1", "x3"] and runs["fixed-a"] == ["x1"]


def test_log_ratio_and_speed_verdict_by_hand():
    from scipy import stats

    # seeds: arm 44, 66, 44 s against a baseline at 88, 88, 220 s: logs ln(1/2), ln(3/4), ln(1/5)
    logs = [math.log(0.5), math.log(0.75), math.log(0.2)]
    m = sum(logs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 2)
    half = stats.t.ppf(0.975, 2) * sd / math.sqrt(3)
    got = sr.log_ratio([44, 66, 44], [88, 88, 220])
    assert got.mean == pytest.approx(math.exp(m))
    assert (got.lo, got.hi) == (
        pytest.approx(math.exp(m - half)),
        pytest.approx(math.exp(m + half)),
    )
    assert got.p == pytest.approx(2 * stats.t.sf(abs(m) / (sd / math.sqrt(3)), 2))
    # equal ratios on every seed (times on the evaluation grid): the limit of no spread
    same = sr.log_ratio([44, 44, 44], [220, 220, 220])
    assert (same.mean, same.lo, same.hi) == (pytest.approx(0.2),) * 3
    assert same.p < 1e-12  # 0 up to the round-off of the three equal logs' mean
    assert sr.log_ratio([220] * 3, [220] * 3).p == 1.0  # both censored everywhere
    assert sr.log_ratio([44], [88]).p is None  # one seed: no test
    with pytest.raises(ConfigError, match="log_ratio"):
        sr.log_ratio([1, 2], [1])
    # verdicts: 5x sooner on every seed is held against f = 2.8 unless the arm is censored;
    # the baseline's censoring does not stop "held" (its time could only be longer)
    assert sr.speed_verdict(same, 0.0, 2.8, base_censored=True) == sr.HELD
    assert sr.speed_verdict(same, 0.0, 2.8, arm_censored=True) == sr.INCONCLUSIVE
    assert sr.speed_verdict(same, 0.0, 6.0) == sr.NOT_HELD  # the interval (5, 5) is below 6
    assert sr.speed_verdict(same, 0.0, 6.0, base_censored=True) == sr.INCONCLUSIVE
    assert sr.speed_verdict(got, 0.5, 1.0) == sr.INCONCLUSIVE  # Holm p 0.5, interval across 1
