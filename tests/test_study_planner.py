"""The planner study (research.study_planner.study_*; research/study_planner/study_planner.py): the per-task metric,
the pilot's rule (no abs(), a target above round 0, a grid of its own), time to target
censored at the budget, Holm, the report on hand-made runs with hand-checked numbers, and
the stages end to end on a tiny model, resumable."""

from __future__ import annotations

import json
import math

import pytest
import tomllib
from scipy import stats

from fedlora.errors import ConfigError
from fedlora.studies.runs import load_run
from research.study_planner import study_rule as sr
from research.study_planner.study_report import write_study_report
from research.study_planner.study_runner import (
    ANALYSED_ROUND_CAP,
    Ledger,
    pilot_stage,
    result_files,
    run_job,
    run_stage,
)
from research.study_planner.study_spec import spec_from_dict
from research.study_planner.study_stats import load_cells
from study_tiny import TINY_STUDY

ACC = sr.parse_metric("arc-e/acc")


def write(root, name, evals, *, correct=None, extra=None):
    """A run directory: one metrics line per (sim_time_s, {task: acc}); predictions of the
    last evaluation (arc-e) when `correct` is given."""
    run = root / name
    run.mkdir(parents=True)
    lines = []
    for r, (t, accs) in enumerate(evals):
        lines.append(
            {
                "round": r,
                "sim_time_s": t,
                "eval": accs,
                "eval_accuracy": sum(accs.values()) / len(accs),
                "eval_mc_losses": {k: 1 - v for k, v in accs.items()},
                **(extra or {}),
            }
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    seed = int(name.rsplit("seed", 1)[1])
    (run / "summary.json").write_text(
        json.dumps({"method": name.split("-")[0], "seed": seed, "stop_reason": "time_budget"})
    )
    if correct is not None:
        pred = {
            "round": len(evals) - 1,
            "task": "arc-e",
            "ids": [f"q{i}" for i in range(10)],
            "correct": correct,
        }
        (run / "predictions.jsonl").write_text(json.dumps(pred) + "\n")
    return run


def pts(*pairs):
    """arc-e at the values given, arc-c 0.3 below (the secondary metric)."""
    return [(t, {"arc-e": v, "arc-c": round(v - 0.3, 9)}) for t, v in pairs]


def test_the_metric_is_one_task_not_the_mean_over_tasks(tmp_path):
    run = load_run(
        write(
            tmp_path,
            "fslora-seed0",
            [(0, {"arc-e": 0.6, "arc-c": 0.2}), (5, {"arc-e": 0.7, "arc-c": 0.3})],
        )
    )
    assert sr.metric_points(run, ACC) == [(0.0, 0.6), (5.0, 0.7)]  # not the mean 0.4, 0.5
    assert sr.metric_points(run, sr.parse_metric("arc-c/acc")) == [(0.0, 0.2), (5.0, 0.3)]
    mc = sr.parse_metric("arc-e/mc_loss")
    assert not mc.higher and sr.metric_points(run, mc) == [
        (0.0, pytest.approx(0.4)),
        (5.0, pytest.approx(0.3)),
    ]
    for bad in ("eval_accuracy", "arc-e", "arc-e/f1", "/acc", 3):
        with pytest.raises(ConfigError, match="study.metric"):
            sr.parse_metric(bad)


def test_a_drop_is_no_improvement_and_the_target_is_above_round_0():
    # fixed-a drops by 0.4 (abs() would make the largest "improvement" 0.4 and the gain 0.2);
    # fslora gains 0.2 within B = 100 (its 0.9 at 300 s is past B): gain 0.5 x 0.2 = 0.1
    pilot = {
        "fixed-a": [(0, 0.5), (50, 0.1)],
        "fixed-b": [(0, 0.5), (60, 0.62)],
        "fslora": [(0, 0.5), (100, 0.7), (300, 0.9)],
    }
    rule = sr.derive_rule(pilot, ACC, 100.0, 0.5, ["fixed-a", "fixed-b"])
    assert rule["target_gain"] == pytest.approx(0.1) and rule["pilot_best_run"] == "fslora"
    assert rule["pilot_target"] == pytest.approx(0.6) and rule["pilot_start"] == 0.5
    assert rule["fixed_best"] == "fixed-b" and rule["pilot_times_s"]["fixed-a"] == [100.0, False]
    with pytest.raises(ConfigError, match="no run improved"):
        sr.derive_rule(
            {"fslora": [(0, 0.5), (50, 0.4)], "fixed-a": [(0, 0.5)]}, ACC, 100.0, 0.5, ["fixed-a"]
        )
    # a loss: a decrease is the improvement
    loss = sr.parse_metric("arc-e/loss")
    r = sr.derive_rule(
        {"fslora": [(0, 2.0), (10, 1.6)], "f": [(0, 2.0), (10, 2.5)]}, loss, 10.0, 0.5, ["f"]
    )
    assert r["target_gain"] == pytest.approx(0.2) and r["pilot_target"] == pytest.approx(1.8)


def test_time_to_target_is_censored_at_the_budget_and_read_from_round_0():
    curve = [(0, 0.5), (40, 0.58), (60, 0.61), (120, 0.9)]
    assert sr.time_to_target(curve, ACC, 0.1, 100.0) == (60, True)
    assert sr.time_to_target(curve, ACC, 0.3, 100.0) == (100.0, False)  # 0.9 is past B
    assert sr.value_at_budget(curve, 100.0) == 0.9  # the round that spends B
    assert sr.value_at_budget(curve[:3], 100.0) == 0.61  # stopped before B: its last
    assert sr.level_on_grid(curve, [0, 50, 119]) == [0.5, 0.58, 0.61]
    assert sr.pilot_budget(257.0, 10.0) == 120.0
    with pytest.raises(ConfigError, match="budget_round_s"):
        sr.pilot_budget(15.0, 10.0)


def test_holm_by_hand():
    # sorted 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 -> max(0.06, 0.04)
    assert sr.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert sr.holm([0.6, 0.5]) == pytest.approx([1.0, 1.0])


def _study(root):
    """A finished study on hand-made runs: budget 100 s, target gain 0.1 from round 0.5."""
    pilot = {
        "fixed-a": pts((0, 0.5), (50, 0.1)),
        "fixed-b": pts((0, 0.5), (60, 0.62)),
        "fslora": pts((0, 0.5), (100, 0.7), (300, 0.9)),
    }
    for lab, ev in pilot.items():
        write(root / "pilot", f"{lab}-seed9", ev)
    curves = {
        lab: [sr.metric_points(load_run(root / "pilot" / f"{lab}-seed9"), ACC)] for lab in pilot
    }
    rule = sr.derive_rule(
        {k: v[0] for k, v in curves.items()}, ACC, 100.0, 0.5, ["fixed-a", "fixed-b"]
    )
    rule.update(
        secondary=["arc-c/acc"],
        seeds=[0, 1, 2],
        pilot_seed=9,
        arms=["fslora", "proposed-inrun", "fixed-best"],
        baselines=["fslora", "fixed-best"],
        proposed=["proposed-inrun"],
        grid_s=10.0,
        target_fraction=0.5,
        budget_from_config=True,
    )
    (root / "rule.json").write_text(json.dumps(rule))
    times = {"fslora": [40, 40, 40], "proposed-inrun": [20, 10, 20], "fixed-best": [80, 80, None]}
    right = {"fslora": 6, "fixed-best": 6, "proposed-inrun": 8}  # of 10 questions at B
    for lab, ts in times.items():
        for seed, t in enumerate(ts):
            ev = pts((0, 0.5), (t, 0.6)) if t else pts((0, 0.5), (50, 0.55))
            ev += pts((100.5, right[lab] / 10))
            write(root, f"{lab}-seed{seed}", ev, correct=[1] * right[lab] + [0] * (10 - right[lab]))
    return root


def test_report_hand_checked_ratio_mcnemar_and_holm(tmp_path):
    out = _study(tmp_path)
    report = write_study_report(out)
    text = report.read_text()
    # proposed / fslora per seed 0.5, 0.25, 0.5: geometric mean 2^(-4/3); logs -ln2·(1, 2, 1)
    # have mean -4/3 ln2 and standard error ln2/3, so t = 4 on 2 degrees of freedom
    gm = 2 ** (-4 / 3)
    se = math.log(2) / 3
    half = stats.t.ppf(0.975, 2) * se
    lo, hi = gm * math.exp(-half), gm * math.exp(half)
    p_fs = 2 * stats.t.sf(4.0, 2)
    # proposed / fixed-best: 20/80, 10/80, 20/100 (censored at B)
    logs = [math.log(0.25), math.log(0.125), math.log(0.2)]
    m = sum(logs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 2)
    p_fb = 2 * stats.t.sf(abs(m) / (sd / math.sqrt(3)), 2)
    small, large = sorted([p_fs, p_fb])
    holm = {p_fs: None, p_fb: None}
    holm[small] = 2 * small
    holm[large] = max(2 * small, large)
    row = next(x for x in text.splitlines() if x.startswith("| proposed-inrun | fslora (best)"))
    assert f"{gm:.3f} [{lo:.3f}, {hi:.3f}] | {p_fs:.3g} | {holm[p_fs]:.3g}" in row
    # McNemar per seed: 2 questions only proposed right, 0 only fslora: pooled 6/0,
    # p = 2 / 2^6 = 0.03125; Holm over the two comparisons: 0.0625
    assert "6/0 of 30 | 0.0312 | 0.0625" in row
    assert "+20.00 [+20.00, +20.00]" in row  # 0.8 − 0.6 on every seed, in points
    row = next(x for x in text.splitlines() if x.startswith("| proposed-inrun | fixed-best"))
    assert f"| {p_fb:.3g} | {holm[p_fb]:.3g} |" in row
    assert "| fixed-best | 1.33 | 1.33 | >= 1.67 (not reached) |" in text
    assert "fixed-best = fixed-b" in text and "pilot seed 9" in text
    # 2^(4/3) = 2.52x over FSLoRA < 2.8, interval reaching above it: inconclusive; sooner than
    # the best baseline (Holm p > 0.05): inconclusive
    assert (
        "| Table I: proposed-inrun reaches the target >= 2.8x sooner than FSLoRA | "
        "**inconclusive** |" in text
    )
    assert "| fslora | 3.35 | 3.20 | 4.23 | 3.83 | fslora: 0.67 |" in text
    assert "## arc-c/acc at the budget, per seed (secondary" in text
    assert "| proposed-inrun | 20.00 | 50.00 | 50.00 | 50.00 |" in text
    # the runs table names each run's machines (these fake runs wrote no machine.jsonl)
    assert "| run | rounds | simulated s | calibration s | stop | machines |" in text
    assert "| fslora-seed0 |" in text and text.count("| unrecorded |") == 9
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64") == 2
    # a rule.json that does not follow from the pilot's runs is refused
    rule = json.loads((out / "rule.json").read_text())
    (out / "rule.json").write_text(json.dumps({**rule, "target_gain": 0.05}))
    with pytest.raises(Exception, match="does not follow from the pilot"):
        write_study_report(out)


def test_study_config_refuses_a_pilot_without_a_grid_and_bad_tables():
    raw = tomllib.loads(TINY_STUDY)
    for key, value, match in [
        ("pilot_eval_every_s", 0.0, "pilot_eval_every_s"),
        ("seeds", [0, 0], "study.seeds"),
        ("pilot_seed", 0, "pilot_seed"),
        ("metric", "eval_accuracy", "study.metric"),
        ("arms", {"x": ["method.name=fedavg"]}, "study.arms"),
    ]:
        bad = {**raw, "study": {**raw["study"], key: value}}
        with pytest.raises(ConfigError, match=match):
            spec_from_dict(bad, "tiny")


def test_resume_skips_finished_runs_resumes_partial_ones_and_retries_failed(tmp_path):
    spec = spec_from_dict(tomllib.loads(TINY_STUDY), "tiny")
    with pytest.raises(ConfigError, match="run the pilot stage first"):
        run_stage(spec, tmp_path, log=print)  # no rule.json: no analysed run
    calls = []

    def fake(cfg, run_dir, *, resume):
        calls.append((run_dir.name, resume))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text("")
        (run_dir / "summary.json").write_text(json.dumps({"sim_time_s": 1.0, "rounds": 1}))
        return {}

    (tmp_path / "a-seed0").mkdir()
    (tmp_path / "a-seed0" / "config.toml").write_text("")  # partial: resumed
    (tmp_path / "b-seed0").mkdir()
    (tmp_path / "b-seed0" / "summary.json").write_text('{"error": "bad"}')  # failed start
    (tmp_path / "c-seed0").mkdir()
    (tmp_path / "c-seed0" / "summary.json").write_text("{}")  # finished, not yet recorded
    ledger = Ledger(tmp_path)
    got = [
        run_job(spec, tmp_path, tmp_path / n, [], ledger=ledger, run_fn=fake, log=print)
        for n in ("a-seed0", "b-seed0", "c-seed0")
    ]
    assert got == ["resumed", "started", "skipped"]
    assert calls == [("a-seed0", True), ("b-seed0", False)]
    again = Ledger(tmp_path)  # a restart reads the ledger back
    assert again.done == {"a-seed0", "b-seed0", "c-seed0"}
    assert [
        run_job(spec, tmp_path, tmp_path / n, [], ledger=again, run_fn=fake, log=print)
        for n in ("a-seed0", "b-seed0")
    ] == ["skipped", "skipped"]
    assert len(calls) == 2


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    spec = spec_from_dict(tomllib.loads(TINY_STUDY), "tiny")
    rule = pilot_stage(spec, out, log=lambda m: None)
    outcomes = run_stage(spec, out, log=lambda m: None)
    return spec, out, rule, outcomes


def test_tiny_pilot_evaluates_on_its_own_grid_and_sets_a_target_above_round_0(tiny_study):
    spec, out, rule, _ = tiny_study
    every = spec.pilot_eval_every_s
    for d in (out / "pilot").iterdir():
        lines = load_run(d).lines
        evaluated = [x["sim_time_s"] for x in lines if x.get("eval")]
        assert len(evaluated) >= 3, d.name  # not round 0 and the last round only
        for k in range(1, int(lines[-1]["sim_time_s"] / every) + 1):
            first = next(x for x in lines if x["sim_time_s"] >= k * every)
            assert first.get("eval"), (d.name, k)
    assert rule["target_gain"] > 0 and rule["pilot_target"] < rule["pilot_start"]  # a loss
    written = (out / "rule.json").read_text()
    assert json.loads(written)["fixed_best"] in spec.fixed_rules
    # a second pilot skips its runs and finds the same rule; a changed rule.json is refused
    assert json.loads(json.dumps(pilot_stage(spec, out, log=lambda m: None))) == json.loads(written)
    (out / "rule.json").write_text(json.dumps({**json.loads(written), "target_gain": 1.0}))
    with pytest.raises(ConfigError, match="exists with another rule"):
        pilot_stage(spec, out, log=lambda m: None)
    (out / "rule.json").write_text(written)


def test_tiny_runs_count_calibration_share_the_grid_and_resume(tiny_study):
    spec, out, rule, outcomes = tiny_study
    assert outcomes == ["started"] * len(outcomes) == ["started"] * 6
    budget, grid = rule["budget_s"], rule["grid_s"]
    for d in sorted(out.glob("*-seed[01]")):
        lines = load_run(d).lines
        start = lines[0].get("calibration_sim_time_s") or 0.0
        assert lines[0]["sim_time_s"] == pytest.approx(start)
        for k in range(1, int((lines[-1]["sim_time_s"] - start) / grid) + 1):
            first = next(x for x in lines if x["sim_time_s"] - start >= k * grid - 1e-9)
            assert first.get("eval"), (d.name, k)
        # every analysed run spends B (the pilot's round cap does not stop it) and is
        # evaluated at the round that spends it
        assert lines[-1]["sim_time_s"] >= budget - 1e-9, d.name
        assert lines[-1].get("eval")
        assert len(lines) == 1 or lines[-2]["sim_time_s"] < budget
    cells = load_cells(out, rule, spec.metric)
    for c in cells["proposed-separate"]:
        cal = c.run.calibration_time_s
        assert cal > 0 and (c.time_s >= cal or not c.reached)
    assert run_stage(spec, out, log=lambda m: None) == ["skipped"] * 6
    assert len((out / "ledger.jsonl").read_text().splitlines()) == 3 + 6
    text = write_study_report(out).read_text()
    # every arm's row: minutes to target per seed, recomputed here from metrics.jsonl alone
    # (arc-e/loss: the first evaluation at or before B whose loss is at or below round 0's
    # minus the target gain; "not reached" shows B)
    budget, gain = rule["budget_s"], rule["target_gain"]
    for arm in rule["arms"]:
        cells = []
        for seed in spec.seeds:
            evals = [
                (x["sim_time_s"], x["eval_losses"]["arc-e"])
                for x in map(json.loads, (out / f"{arm}-seed{seed}" / "metrics.jsonl").open())
                if x.get("eval_losses")
            ]
            hit = [t for t, v in evals if t <= budget + 1e-9 and v <= evals[0][1] - gain + 1e-9]
            cells.append(f"{hit[0] / 60:.2f}" if hit else f">= {budget / 60:.2f} (not reached)")
        assert f"| {arm} | " + " | ".join(cells) + " |" in text, arm


def test_bench_runner_refuses_an_unfixed_protocol_and_reports(tmp_path, capsys):
    from pathlib import Path

    from tiny_runs import load_script

    path = Path(__file__).parents[1] / "research" / "study_planner" / "study_planner.py"
    bench = load_script("research/study_planner/study_planner.py")
    # the committed config is valid and its protocol fixed
    assert bench.main(["check"]) == 0
    assert "protocol_fixed = false" not in capsys.readouterr().out
    # the same config with the protocol not fixed: `pilot` refuses and writes nothing
    committed = path.with_name("study_planner.toml")
    unfixed = tmp_path / "unfixed.toml"
    text = committed.read_text()
    assert "protocol_fixed = true" in text
    unfixed.write_text(text.replace("protocol_fixed = true", "protocol_fixed = false"))
    assert bench.main(["check", "--config", str(unfixed)]) == 0
    assert "protocol_fixed = false" in capsys.readouterr().out
    assert bench.main(["pilot", "--config", str(unfixed), "--out", str(tmp_path / "p")]) == 2
    assert "protocol_fixed = false" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()
    assert bench.main(["report", "--out", str(tmp_path / "none")]) == 2
    assert "no " in capsys.readouterr().err
    assert bench.main(["report", "--out", str(_study(tmp_path / "s"))]) == 0
    assert (tmp_path / "s" / "report.html").is_file()


def test_runners_share_the_jobs_by_seed_arm_and_pilot_label(tmp_path):
    spec = spec_from_dict(tomllib.loads(TINY_STUDY), "tiny")
    calls = []

    def fake(cfg, run_dir, *, resume):
        calls.append(run_dir.relative_to(tmp_path).as_posix())
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text("")
        (run_dir / "summary.json").write_text(json.dumps({"sim_time_s": 1.0, "rounds": 1}))
        return {}

    # a pilot share runs its labels only and writes no rule while another share is missing
    assert pilot_stage(spec, tmp_path, run_fn=fake, log=print, only=["fslora"]) is None
    assert calls == ["pilot/fslora-seed5"] and not (tmp_path / "rule.json").exists()
    with pytest.raises(ConfigError, match=r"pilot --only: nope unknown \(allowed: fixed-full"):
        pilot_stage(spec, tmp_path, run_fn=fake, log=print, only=["nope"])
    rule = {"budget_s": 2.0, "grid_s": 0.5, "fixed_best": "fixed-0.5"}
    (tmp_path / "rule.json").write_text(json.dumps(rule))
    calls.clear()
    got = run_stage(spec, tmp_path, run_fn=fake, log=print, seeds=[1], arms_only=["fslora"])
    assert got == ["started"] and calls == ["fslora-seed1"]
    run_stage(spec, tmp_path, run_fn=fake, log=print, seeds=[0])
    assert calls[1:] == ["fslora-seed0", "proposed-separate-seed0", "fixed-best-seed0"]
    outcomes = run_stage(spec, tmp_path, run_fn=fake, log=print)
    assert outcomes == ["skipped"] * 4 + ["started"] * 2  # seed 0's three, then seed 1's
    with pytest.raises(ConfigError, match=r"run --seeds: 7 unknown \(allowed: 0, 1\)"):
        run_stage(spec, tmp_path, run_fn=fake, log=print, seeds=[7])


def test_commit_takes_the_results_not_the_checkpoints(tmp_path):
    run = tmp_path / "fslora-seed0"
    for name in ("config.toml", "metrics.jsonl", "predictions.jsonl", "summary.json", ".lock"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("x")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "round-000005.safetensors").write_text("x")
    (run / "adapter").mkdir()
    names = [p.name for p in result_files(run)]
    assert names == ["config.toml", "metrics.jsonl", "predictions.jsonl", "summary.json"]
    # a separate calibration's runs: their records too, never their checkpoints
    sub = run / "calibration" / "run-0-q0.3-k16"
    (sub / "checkpoints").mkdir(parents=True)
    (sub / "checkpoints" / "round-000005.safetensors").write_text("x")
    for name in ("metrics.jsonl", "config.toml", ".fedlora-run.json"):
        (sub / name).write_text("x")
    rel = [p.relative_to(run).as_posix() for p in result_files(run)]
    assert rel[4:] == [
        "calibration/run-0-q0.3-k16/config.toml",
        "calibration/run-0-q0.3-k16/metrics.jsonl",
    ]


def test_analysed_runs_are_not_stopped_by_the_pilots_round_cap(tmp_path):
    # an arm with cheap rounds in simulated time needs more rounds than the pilot's cap to
    # spend B: the analysed runs stop at the budget, not at training.rounds
    spec = spec_from_dict(tomllib.loads(TINY_STUDY), "tiny")
    (tmp_path / "rule.json").write_text(
        json.dumps({"budget_s": 2.0, "grid_s": 0.5, "fixed_best": "fixed-0.5"})
    )
    seen = []

    def fake(cfg, run_dir, *, resume):
        seen.append((cfg.training.rounds, cfg.training.time_budget_s))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text("{}")
        return {}

    run_stage(spec, tmp_path, run_fn=fake, log=lambda m: None, seeds=[0], arms_only=["fslora"])
    assert seen == [(ANALYSED_ROUND_CAP, 2.0)] and ANALYSED_ROUND_CAP > spec.round_cap()


def test_report_refuses_a_run_whose_config_was_edited(tiny_study):
    # issue 39 item 15: a run's config.toml edited by hand (an lr no arm sets) is refused
    _, out, _, _ = tiny_study
    path = out / "fslora-seed1" / "config.toml"
    text = path.read_text()
    assert "\nlr = 0.05\n" in text
    path.write_text(text.replace("\nlr = 0.05\n", "\nlr = 5.0\n"))
    try:
        with pytest.raises(Exception, match=r"differs from .* at training.lr \(5.0 vs 0.05\)"):
            write_study_report(out)
    finally:
        path.write_text(text)
    write_study_report(out)  # as written by the runner: accepted
