"""research/references/references_study.py (research/references/references_study.md): Fieller's set for the share of the
centralized gain, checked against the paired t test it inverts, and the summary of a suite
directory written by hand (gains and differences by hand; arms that are not paired refused)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fedlora.config import dump_toml, load_config
from fedlora.errors import DataError
from tiny_runs import load_script

ROOT = Path(__file__).resolve().parents[1]
study = load_script("research/references/references_study.py")


def test_fieller_set_is_where_the_paired_t_test_of_x_minus_rho_y_does_not_reject():
    x, y = [0.020, 0.031, 0.025], [0.050, 0.061, 0.058]
    res = study.fieller(x, y)
    assert res["bounded"] and res["ratio"] == pytest.approx(np.mean(x) / np.mean(y))
    lo, hi = res["ci95"]
    crit = stats.t.ppf(0.975, 2)
    for rho in (lo, hi):  # on the boundary the t statistic of d = x − ρy is the critical value
        t = stats.ttest_1samp(np.array(x) - rho * np.array(y), 0.0).statistic
        assert abs(t) == pytest.approx(crit, rel=1e-9)
    inside = stats.ttest_1samp(np.array(x) - res["ratio"] * np.array(y), 0.0).statistic
    assert abs(inside) < crit


def test_fieller_exact_proportion_and_an_undistinguished_denominator():
    y = [0.04, 0.06, 0.05]
    res = study.fieller([v / 2 for v in y], y)  # x = y/2 exactly: the set is {0.5}
    assert res["ci95"] == [pytest.approx(0.5), pytest.approx(0.5)]
    res = study.fieller([0.01, 0.02, 0.0], [0.05, -0.04, 0.01])  # ȳ not distinguished from 0
    assert not res["bounded"] and res["ci95"] is None


TINY = ["model.name=tiny-llama", 'data.eval_tasks=["arc-e"]']
ARM = {"federated": [], "centralized": ["method.name=centralized"], "local": ["method.name=local"]}


def _write(out: Path, label: str, seed: int, acc0: float, acc: float, *extra: str) -> None:
    d = out / f"{label}-seed{seed}"
    d.mkdir(parents=True)
    cfg = load_config(None, [*TINY, *ARM[label], f"training.seed={seed}", *extra])
    (d / "config.toml").write_text(dump_toml(cfg), encoding="utf-8")
    summary = {
        "rounds": 100,
        "initial_eval": {"arc-e": {"accuracy": acc0, "n": 500}},
        "final_eval": {"arc-e": {"accuracy": acc, "n": 500}},
    }
    (d / "summary.json").write_text(json.dumps(summary), encoding="utf-8")


def test_summary_gains_and_paired_differences_by_hand(tmp_path):
    finals = {0: (0.50, 0.54, 0.58, 0.51), 1: (0.50, 0.55, 0.60, 0.50)}  # round 0, f, c, l
    for seed, (acc0, *accs) in finals.items():
        for label, acc in zip(ARM, accs):
            _write(tmp_path, label, seed, acc0, acc)
    res = study.summarize(tmp_path, [0, 1])
    assert res["gain"]["federated"]["values"] == pytest.approx([0.04, 0.05])
    assert res["gain"]["centralized"]["mean"] == pytest.approx(0.09)
    assert res["federated_minus_local"]["values"] == pytest.approx([0.03, 0.05])
    # two seeds: t_{0.975,1} = 12.706, sd of (0.03, 0.05) = 0.01414: half-width 0.1271
    lo, hi = res["federated_minus_local"]["ci95"]
    assert (hi - lo) / 2 == pytest.approx(12.7062 * 0.0141421 / np.sqrt(2), rel=1e-4)
    assert res["share_of_centralized_gain"]["ratio"] == pytest.approx(0.045 / 0.09)
    assert "federated − local" in study.render(res)


def test_summary_refuses_arms_that_are_not_paired(tmp_path):
    for label in ARM:  # local trained with another batch size: not the same setting
        _write(tmp_path, label, 0, 0.5, 0.55, *(["training.batch_size=8"] * (label == "local")))
    with pytest.raises(DataError, match="local differs from federated in training.batch_size"):
        study.summarize(tmp_path, [0])
    other = tmp_path / "b"
    for label in ARM:  # another round 0: not the same questions or initial adapter
        _write(other, label, 0, 0.5 if label != "centralized" else 0.52, 0.55)
    with pytest.raises(DataError, match="not paired"):
        study.summarize(other, [0])
    with pytest.raises(DataError, match="no summary.json"):
        study.summarize(other, [1])


def test_the_study_config_is_the_demo_with_the_confirmation_optimizer():
    from fedlora.studies.experiments import load_suite

    spec = load_suite("references", str(ROOT / "research/references/references.toml"))
    assert spec.seeds == (0, 1, 2) and spec.labels == ("federated", "centralized", "local")
    demo = load_config(str(ROOT / "configs/demo.toml"), [])
    fed = spec.config_for("federated", 0)
    assert fed.training.optimizer == "adamw" and fed.training.lr == 0.001
    assert fed.training.optimizer_state == "reset"
    same = fed.replace(training=demo.training.__class__(**{
        **demo.training.__dict__, "optimizer": "adamw", "lr": 0.001,
        "target_accuracy": 0.0}))  # fmt: skip
    assert same == fed  # everything else is the demo's (compare switches off the target stop)
    for label in ("centralized", "local"):
        assert spec.config_for(label, 0).method.budget_of == demo.method.name
