"""The powered report (fedlora.powered): statistics over seeds, targets by rule, claims and
band plots, on hand-made run directories with hand-computed expected values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedlora import powered
from fedlora.errors import ConfigError
from fedlora.experiments import report_suite
from fedlora.report import load_run

T975_2 = 4.302652729911275  # t quantile 0.975 with 2 degrees of freedom (tables)


def write_run(
    root: Path,
    label: str,
    seed: int,
    evals: list[tuple[float, float, float]],
    *,
    method: str | None = None,
    task: str = "arc-e",
    calibration_s: float = 0.0,
    end_s: float | None = None,
    plan: dict | None = None,
) -> Path:
    """A run directory: one metrics line per (sim_time_s, accuracy, eval_loss), round 0 first;
    optionally a last line without evaluation at end_s."""
    run = root / f"{label}-seed{seed}"
    run.mkdir(parents=True)
    lines = []
    for r, (t, acc, loss) in enumerate(evals):
        lines.append(
            {
                "round": r,
                "sim_time_s": t,
                "calibration_sim_time_s": calibration_s if r == 0 else None,
                "train_loss": None if r == 0 else 1.0,
                "eval": {task: acc},
                "eval_accuracy": acc,
                "eval_loss": loss,
                "eval_losses": {task: loss},
                "eval_n": {task: 500},
                "eval_majority": {task: 0.28},
                "eval_chance": {task: 0.25},
            }
        )
    if end_s is not None:
        lines.append({"round": len(lines), "sim_time_s": end_s, "train_loss": 1.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = {"method": method or label.split("-")[0], "seed": seed, "stop_reason": "time_budget"}
    if plan is not None:
        summary["plan"] = plan
    (run / "summary.json").write_text(json.dumps(summary))
    return run


# ----------------------------------------------------------------------------- statistics


def test_paired_ratio_geometric_mean_and_interval_by_hand():
    # ratios 2, 4, 4: logs ln2·(1, 2, 2), mean ln2·5/3, sd ln2/√3, se ln2/3
    r = powered.paired_ratio([10, 20, 40], [True] * 3, [5, 5, 10], [True] * 3)
    assert r.mean == pytest.approx(2 ** (5 / 3))
    assert r.lo == pytest.approx(2 ** (5 / 3 - T975_2 / 3))
    assert r.hi == pytest.approx(2 ** (5 / 3 + T975_2 / 3))
    assert r.lower_valid and r.upper_valid and r.n == 3
    assert powered.ratio_verdict(r, 1.0) == powered.HELD  # lo = 1.17 > 1
    assert powered.ratio_verdict(r, 2.8) == powered.INCONCLUSIVE  # 1.17 < 2.8 < 8.6
    assert powered.ratio_verdict(r, 9.0) == powered.NOT_HELD  # hi = 8.6 < 9
    assert r.text() == f"3.17x [{2 ** (5 / 3 - T975_2 / 3):.2f}, {2 ** (5 / 3 + T975_2 / 3):.2f}]"


def test_paired_ratio_with_censored_seeds_keeps_only_the_valid_side():
    # the reference never reached in seed 0: its ratio is >= 2, so only the lower end is valid
    r = powered.paired_ratio([10, 20, 40], [False, True, True], [5, 5, 10], [True] * 3)
    assert r.lower_valid and not r.upper_valid
    assert r.text().startswith(">= 3.17x [1.17, ?]")
    assert powered.ratio_verdict(r, 1.0) == powered.HELD
    assert powered.ratio_verdict(r, 9.0) == powered.INCONCLUSIVE  # the upper end is not known
    # the method censored: only the upper end is valid
    m = powered.paired_ratio([10, 20, 40], [True] * 3, [5, 5, 10], [True, False, True])
    assert m.upper_valid and not m.lower_valid and m.text().startswith("<= ")
    assert powered.ratio_verdict(m, 1.0) == powered.INCONCLUSIVE
    # both censored in one seed: nothing is known
    both = powered.paired_ratio([10, 20], [False, True], [5, 5], [False, True])
    assert both.text() == "n/a (censored both ways)"
    assert powered.ratio_verdict(both, 1.0) == powered.INCONCLUSIVE
    # one seed: no interval
    one = powered.paired_ratio([10], [True], [5], [True])
    assert one.mean == pytest.approx(2.0) and one.lo is None and one.text() == "2.00x"
    assert powered.ratio_verdict(one, 1.0) == powered.INCONCLUSIVE
    with pytest.raises(ConfigError, match="paired_ratio"):
        powered.paired_ratio([1, 2], [True, True], [1], [True])


def test_paired_diff_t_test_by_hand():
    # d = (0.1, 0, 0.2): mean 0.1, sd 0.1, t = √3; with 2 df the two-sided p = 1 − t/√(t² + 2)
    d = powered.paired_diff([0.5, 0.6, 0.7], [0.4, 0.6, 0.5])
    assert d.mean == pytest.approx(0.1) and d.n == 3
    assert d.ci == pytest.approx(T975_2 * 0.1 / math.sqrt(3))
    assert d.p == pytest.approx(1 - math.sqrt(3) / math.sqrt(5))
    same = powered.paired_diff([0.5, 0.5], [0.5, 0.5])
    assert same.mean == 0 and same.p == 1.0
    assert powered.paired_diff([0.5], [0.4]).p is None
    with pytest.raises(ConfigError, match="paired_diff"):
        powered.paired_diff([], [])


@pytest.mark.parametrize(
    "mean, ci, verdict",
    [(0.005, 0.01, powered.HELD), (0.1, 0.02, powered.NOT_HELD),
     (-0.1, 0.02, powered.NOT_HELD), (0.01, 0.02, powered.INCONCLUSIVE),
     (0.0, None, powered.INCONCLUSIVE)],
)  # fmt: skip
def test_similar_verdict_is_an_equivalence_test(mean, ci, verdict):
    assert powered.similar_verdict(powered.PairedDiff(mean, ci, None, 3), 0.02) == verdict


def test_summary_text_marks_censoring():
    assert powered.summarize([10.0, 20.0, 30.0]).text() == f"20.0 ± {T975_2 * 10 / 3**0.5:.1f}"
    assert powered.summarize([10.0, 20.0], censored=1).text() == ">= 15.0 (1/2 censored)"
    assert powered.summarize([0.5]).text(100) == "50.0"


# ----------------------------------------------------------------------------- targets by rule

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
    result = powered.rule_targets([load_run(r) for r in runs], ["arc-e"], 100.0, RULE)
    floor = 0.28 + 4 * math.sqrt(0.28 * 0.72 / 500)
    assert result["accuracy"] == {"arc-e": pytest.approx(floor)}
    assert result["loss"] == {"arc-e": 1.3}
    d = result["details"]["arc-e"]
    assert d["slowest"] == "heterolora" and d["floored"] and d["at_s"] == 60.0
    assert d["accuracy_at"] == {"fslora": 0.40, "heterolora": 0.30}
    # without the floor the slowest baseline's level is the target
    no_floor = powered.rule_targets([load_run(r) for r in runs], ["arc-e"], 100.0,
                                    {**RULE, "floor_se": 0})  # fmt: skip
    assert no_floor["accuracy"] == {"arc-e": 0.30}
    text = powered.targets_toml(result, powered.check_rule(RULE), "pilot")
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
        powered.check_rule(rule)


def test_rule_targets_bad_input(tmp_path):
    run = load_run(write_run(tmp_path, "fslora", 1, [(0, 0.25, 1.5)]))
    with pytest.raises(ConfigError, match="time_budget_s"):
        powered.rule_targets([run], ["arc-e"], 0.0, RULE)
    with pytest.raises(ConfigError, match="no pilot baseline evaluated 'obqa'"):
        powered.rule_targets([run], ["obqa"], 10.0, RULE)
    prop = load_run(write_run(tmp_path, "proposed", 1, [(0, 0.25, 1.5)]))
    with pytest.raises(ConfigError, match="no baseline run"):
        powered.rule_targets([prop], ["arc-e"], 10.0, RULE)


# ----------------------------------------------------------------------------- claims, report

# time (s) at which each seed first reaches 40% (None: never, censored at 120 s)
TIMES = {
    "proposed": (10, 12, 11),
    "fslora": (40, 44, 50),
    "fedstacklora": (60, 66, 70),
    "heterolora": (100, 110, None),
}


def table1_suite(root: Path) -> Path:
    for label, times in TIMES.items():
        for seed, t in enumerate(times):
            final = 0.50 + (0.005 if label == "proposed" and seed == 1 else 0.0)
            evals = [(0.0 if label != "proposed" else 5.0, 0.25, 1.5)]
            if t is not None:
                evals += [(t, 0.40, 1.2), (200.0, final, 1.0)]
            else:
                evals += [(120.0, 0.35, 1.3)]  # censored: its clock ends at 120 s
            write_run(root, label, seed, evals, calibration_s=5.0 if label == "proposed" else 0.0)
    (root / "suite.toml").write_text(
        'suite = "table1"\ntitle = "Table I"\nlabels = ["proposed", "fslora", '
        '"heterolora", "fedstacklora"]\nseeds = [0, 1, 2]\nsimilar_margin = 0.02\n'
        'target_rule = "the rule"\n\n[targets]\n"arc-e" = 0.4\n\n[target_losses]\n"arc-e" = 1.2\n'
    )
    return root


def test_claims_on_a_synthetic_table1(tmp_path):
    runs = [load_run(d) for d in sorted(table1_suite(tmp_path).iterdir()) if d.is_dir()]
    gs = powered.groups(runs, ["proposed", "fslora", "heterolora", "fedstacklora"])
    rows = {r["claim"]: r for r in powered.claims("table1", gs, {"arc-e": 0.4})}
    rows = {
        k.split(":")[0].split(" (")[0] if "speed-up" not in k else k: r for k, r in rows.items()
    }
    # ordering: every adjacent pair is faster with an interval above 1 (heterolora seed 2 is
    # censored, which only makes its ratio larger)
    order = rows["Table I ordering"]
    assert order["verdict"] == powered.HELD
    assert "fedstacklora/proposed" not in order["numbers"]  # adjacent pairs only
    assert order["numbers"].startswith("fslora/proposed ")
    assert "heterolora/fedstacklora >= " in order["numbers"]
    # speed-up over fslora: ratios 40/10, 44/12, 50/11 (by hand: lo = 3.10 > 2.8)
    logs = [math.log(40 / 10), math.log(44 / 12), math.log(50 / 11)]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    lo, hi = math.exp(mean - T975_2 * sd / 3**0.5), math.exp(mean + T975_2 * sd / 3**0.5)
    speed = next(r for r in rows.values() if r["claim"].endswith("(paper: 2.8–4.2x)"))
    assert speed["verdict"] == powered.HELD and lo > 2.8
    assert speed["numbers"] == f"{math.exp(mean):.2f}x [{lo:.2f}, {hi:.2f}]"
    # without the calibration's 5 s: ratios 40/5, 44/7, 50/6
    bare = next(r for r in rows.values() if "without the calibration" in r["claim"])
    logs = [math.log(40 / 5), math.log(44 / 7), math.log(50 / 6)]
    assert bare["numbers"].startswith(f"{math.exp(sum(logs) / 3):.2f}x")
    # similar final accuracy: vs fslora/fedstacklora d = (0, 0.005, 0): ± t·0.00167 = ±0.0072,
    # inside ±0.02 (held); vs heterolora seed 2 ends at 0.35: d = (0, 0.005, 0.15), an
    # interval of ±0.21 across the margin -> the conjunction is inconclusive
    similar = rows["similar final accuracy"]
    assert similar["verdict"] == powered.INCONCLUSIVE
    assert "vs fslora +0.2 ± 0.7 pts" in similar["numbers"]
    assert "vs heterolora +5.2 ± 21.2 pts" in similar["numbers"]


def test_report_appends_the_powered_sections_and_band_plots(tmp_path):
    suite = table1_suite(tmp_path / "suite")
    path = report_suite([suite], tmp_path / "out")
    text = path.read_text()
    assert "## Over seeds (powered report)" in text
    assert "Targets fixed before the main runs by the rule: the rule" in text
    assert (
        "| method | seeds | time to 40.0% (s) | without calibration (s) | speed-up over fslora |"
        in text
    )
    # proposed: mean of 10, 12, 11 = 11 ± t·1/√3; without its 5 s of calibration 6
    assert f"| proposed | 3 | 11.0 ± {T975_2 / 3**0.5:.1f} | 6.0 ± {T975_2 / 3**0.5:.1f} |" in text
    assert "| heterolora | 3 | >= 110.0 (1/3 censored) | - |" in text  # (100 + 110 + 120)/3
    assert "## Claims of the paper" in text and "| Table I ordering" in text
    assert "CPU: 12 runs, Σ wall_s = 0.00 h" in text
    assert "| fslora | 3 | +0.2 ± 0.7 | " in text  # paired accuracy at the budget, points
    for name in ("accuracy_bands.png", "eval_loss_bands.png"):
        assert (tmp_path / "out" / name).stat().st_size > 1000
        assert f"({name})" in text


def test_band_mean_and_interval_on_the_step_curves(tmp_path):
    a = load_run(write_run(tmp_path, "x", 0, [(0, 0.2, 1), (10, 0.4, 1)], end_s=20))
    b = load_run(write_run(tmp_path, "x", 1, [(0, 0.3, 1), (5, 0.5, 1)], end_s=10))
    xs, mean, lo, hi = powered.band([a, b], "arc-e", "accuracy", [0, 5, 10, 15])
    # at 15 s run b has ended: no point; at 10 s: 0.4 and 0.5
    assert xs == [0, 5, 10]
    assert mean == pytest.approx([0.25, 0.35, 0.45])
    half = 12.706204736174698 * 0.05  # t(0.975, 1) · sd / √2 with sd = 0.1/√2
    assert hi[0] - mean[0] == pytest.approx(half) and mean[0] - lo[0] == pytest.approx(half)


def test_plan_section_lists_predicted_and_observed_rounds(tmp_path):
    plan = {"predicted_rounds": 7.5, "observed_rounds": None, "rounds_run": 12,
            "degenerate": True, "degenerate_reasons": ["every k_n = 1"],
            "calibration": [{"q": 0.3, "k": 4, "observed_rounds": 5.0, "predicted_rounds": 4.0,
                             "reached_f_s": False}]}  # fmt: skip
    run = load_run(write_run(tmp_path, "proposed", 0, [(0, 0.25, 1.5)], plan=plan))
    text = "\n".join(powered._plan_section(powered.groups([run])))
    assert "| proposed | 0 | 7.5 | >= 12 | DEGENERATE: every k_n = 1 | " in text
    assert "q=0.3 k=4: 5 vs 4 (F_s not reached)" in text


def test_ratio_text_keeps_extreme_ratios_short():
    # a target met at the calibration's end: without it the time is ~0 (raised to 1e-9 s)
    r = powered.paired_ratio([2.0], [True], [0.0], [True])
    assert r.text() == "2e+09x"
    assert powered.paired_ratio([1.0], [True], [500.0], [True]).text() == "0.002x"


def _predictions(run: Path, correct: list[int], task: str = "arc-e") -> None:
    ids = [f"q{i}" for i in range(len(correct))]
    line = {"round": 5, "task": task, "ids": ids, "pred": [0] * len(ids), "correct": correct,
            "nll": [1.0] * len(ids)}  # fmt: skip
    (run / "predictions.jsonl").write_text(json.dumps(line) + "\n")


def test_pooled_mcnemar_sums_the_discordant_questions_over_seeds(tmp_path):
    # seed 0: proposed right on q0..q3, fslora only on q3 -> 3 / 0; seed 1: 2 / 0.
    # Pooled: 6 questions, 5 / 0 -> exact two-sided p = 2 · (1/2)^5 = 0.0625
    evals = [(0, 0.25, 1.5), (10, 0.5, 1.0)]
    p0, p1 = (write_run(tmp_path, "proposed", s, evals) for s in (0, 1))
    f0, f1 = (write_run(tmp_path, "fslora", s, evals) for s in (0, 1))
    _predictions(p0, [1, 1, 1, 1])
    _predictions(f0, [0, 0, 0, 1])
    _predictions(p1, [1, 1])
    _predictions(f1, [0, 0])
    a, b = [load_run(p) for p in (p0, p1)], [load_run(f) for f in (f0, f1)]
    assert powered.pooled_mcnemar(a, b, "arc-e") == (6, 5, 0, pytest.approx(0.0625))
    assert powered.pooled_mcnemar(a, b, "obqa") is None  # no such task evaluated
    text = powered.render([*a, *b], {"arc-e": 0.4})
    assert "| fslora | 2 | +0.0 ± 0.0 | 1 | +0.0000 ± 0.0000 | 1 | 6: 5 / 0, p = 0.0625 |" in text
    (f1 / "predictions.jsonl").unlink()  # a run without predictions: no test
    assert powered.pooled_mcnemar(a, [load_run(f) for f in (f0, f1)], "arc-e") is None
