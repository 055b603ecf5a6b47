"""Algorithm 2 on real training (`fedlora.federation.calibration`,
`fedlora.federation.calibration_plan`): the calibration runs, the fit, the plan as a value.
The calibration runs are a stand-in (`_fake_engine`) handed to `prepare_proposed` as its
`run_one`, as the run's entry hands it the in-process run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.calibration import (
    calibration_config,
    calibration_settings,
    plan_outcome,
    prepare_proposed,
    rounds_to_loss,
    smoothed_losses,
)
from fedlora.federation.methods import make_method
from fedlora.federation.methods.proposed import Plan, Proposed
from fedlora.llm.device import resolve_runtime


def _config(*args):
    """A config with its device and dtype resolved, as the run's entry hands it on."""
    return resolve_runtime(load_config(*args)).cfg


# ----------------------------------------------------------------------------- calibration pieces


def test_calibration_settings_use_two_q_and_two_k():
    assert calibration_settings(16) == [(0.3, 16), (0.15, 16), (0.3, 4), (0.15, 4)]
    assert calibration_settings(2) == [(0.3, 2), (0.15, 2), (0.3, 1), (0.15, 1)]
    assert calibration_settings(3) == [(0.3, 3), (0.15, 3), (0.3, 1), (0.15, 1)]
    with pytest.raises(ConfigError, match="lora.rank = 1 is invalid.*>= 2"):
        calibration_settings(1)


def test_smoothed_losses_trailing_mean_over_non_empty_rounds():
    # rounds: 4, empty, 2, 6, 1 -> 4, 4 (repeated), 3, 4, 3 (mean of 2, 6, 1)
    assert smoothed_losses([None, 4.0, None, 2.0, 6.0, 1.0], window=3) == [
        None, 4.0, 4.0, 3.0, 4.0, 3.0,
    ]  # fmt: skip
    assert rounds_to_loss([None, 4.0, None, 2.0, 6.0, 1.0], 3.0, window=3) == 4
    assert rounds_to_loss([4.0, 4.0], 1.0) is None


def test_calibration_config_is_sketched_with_every_client_alike():
    cfg = _config(None, ["planner.calibration=separate", "data.n_clients=3", "planner.calibration_rounds=7", "training.seed=5",
                             "training.eval_every_s=2.5", "training.time_budget_s=9",
                             "training.target_loss=0.5"])  # fmt: skip
    c = calibration_config(cfg, 0.3, 4)
    assert c.training.eval_every_s == 0.0 and c.training.time_budget_s == 0.0
    assert c.training.target_loss == 0.0
    assert (c.method.name, c.method.q, c.method.k) == ("sketched", (0.3,) * 3, (4,) * 3)
    assert (c.training.rounds, c.training.eval_every, c.training.seed) == (7, 7, 5)
    assert c.training.target_accuracy == 0.0 and c.data.eval_limit == 8
    assert c.data.n_clients == 3 and c.network == cfg.network


# Known constants A=105, B=1, C=0.05, D=0.0125 with a = (.1,.2,.3,.4): Σa² = 0.3, so
# Y = 0.3/q ∈ {1, 2} and Z = Y·(16/k)² ∈ {1, 2, 16, 32}; R = A/(B − CY − DZ) is then
# 105/(15/16) = 112, 105/(7/8) = 120, 105/(3/4) = 140 and 105/(1/2) = 210 for the settings
# (0.3, 16), (0.15, 16), (0.3, 4), (0.15, 4).
KNOWN_R = {(0.3, 16): 112, (0.15, 16): 120, (0.3, 4): 140, (0.15, 4): 210}


def _fake_engine(calls: list):
    """A stand-in for the entry's in-process run: one metrics line per round, 1 s each; the loss is
    2.0 in round 1 (F_s = 1.0), 1.2 until round R−1 and 0.3 from R on, so the smoothed loss
    first drops to <= 1.0 exactly at round R = KNOWN_R[(q, k)]."""

    def run(cfg, run_dir, *, resume=False, quiet=False, log=None, stop=None):
        q, k = cfg.method.q[0], cfg.method.k[0]
        calls.append((q, k) if not resume else ("resume", q, k, cfg.training.rounds))
        big_r = KNOWN_R[(q, k)]
        path = Path(run_dir) / "metrics.jsonl"
        done = len(path.read_text().splitlines()) - 1 if resume else 0
        if not resume:
            path.write_text(json.dumps({"round": 0, "sim_time_s": 0.0, "train_loss": None}) + "\n")
        rows = ["client,n_examples,a,tau_full_s,t_full"]
        rows += [f"{i},{n},{a},{tau},{t}" for i, (n, a, tau, t) in enumerate(
            [(10, 0.1, 1.0, 4e6), (20, 0.2, 2.0, 2e6), (30, 0.3, 0.5, 8e6), (40, 0.4, 1.5, 1e6)])]  # fmt: skip
        (Path(run_dir) / "clients.csv").write_text("\n".join(rows) + "\n")
        for r in range(done + 1, cfg.training.rounds + 1):
            loss = 2.0 if r == 1 else (1.2 if r < big_r else 0.3)
            line = {"round": r, "sim_time_s": float(r), "train_loss": loss}
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
            if stop is not None and stop(line):
                break
        summary = {"rounds": r, "sim_time_s": float(r)}
        (Path(run_dir) / "summary.json").write_text(json.dumps(summary))
        return summary

    return run


def test_prepare_proposed_recovers_known_constants_and_saves_the_plan(tmp_path):
    # Prepare
    calls: list = []
    fake = _fake_engine(calls)
    cfg = _config(
        None,
        ["planner.calibration=separate", "data.n_clients=4", "lora.rank=16",
         "planner.calibration_rounds=300",
         "method.name=proposed"],
    )  # fmt: skip
    # Execute
    new_cfg, planned = prepare_proposed(cfg, tmp_path, run_one=fake, log=lambda m: None)
    calibration_s = planned.calibration_s
    # Assert: four runs, each stopped at its R by the engine's stop callback
    assert calls == list(KNOWN_R)
    plan = json.loads((tmp_path / "plan.json").read_text())
    runs = plan["calibration"]["runs"]
    assert [r["rounds"] for r in runs] == [112, 120, 140, 210]
    assert [r["rounds_run"] for r in runs] == [112, 120, 140, 210]
    assert plan["calibration"]["loss_target"] == plan["calibration"]["loss_used"] == 1.0
    assert calibration_s == plan["calibration"]["sim_time_s"] == 112 + 120 + 140 + 210
    assert [r["reached"] for r in runs] == [True] * 4
    assert "0.5 x the first round's train loss" in plan["calibration"]["loss_rule"]
    # the exact constants predict every run's rounds: zero residuals, a plan that is checked
    fit = plan["fit"]
    assert [f["predicted_rounds"] for f in fit] == pytest.approx([112, 120, 140, 210])
    assert [f["row_residual"] for f in fit] == pytest.approx([0] * 4, abs=1e-9)
    assert set(plan["degeneracy"]) >= {"degenerate", "reasons", "k_at_1", "q_at_lower_bound"}
    assert plan["degeneracy"]["degenerate"] == (plan["degeneracy"]["reasons"] != [])
    c = plan["constants"]
    assert [c["A"], c["B"], c["C"], c["D"]] == pytest.approx([105, 1, 0.05, 0.0125], rel=1e-9)
    q, k = np.array(plan["q"]), np.array(plan["k"])
    assert q.shape == (4,) and np.all((q > 0) & (q <= 1)) and np.all((k >= 1) & (k <= 16))
    # the plan travels as a value: plan.json's q and k
    assert planned == Plan(tuple(plan["q"]), tuple(plan["k"]), calibration_s) and new_cfg == cfg
    a = np.array([0.1, 0.2, 0.3, 0.4])
    with pytest.raises(ConfigError, match="needs Algorithm 2's plan"):
        make_method(new_cfg, a, np.random.default_rng(0))
    method = make_method(new_cfg, a, np.random.default_rng(0), plan=planned)
    assert isinstance(method, Proposed)
    np.testing.assert_allclose(method.q, q)
    np.testing.assert_array_equal(method.k, k)
    # Execute again: plan.json is reused, nothing runs
    calls.clear()
    again, again_plan = prepare_proposed(cfg, tmp_path, run_one=fake, log=lambda m: None)
    assert calls == [] and again_plan == planned and again == new_cfg


def test_prepare_proposed_fallback_when_a_run_never_reaches_f_s(tmp_path):
    # The cap (150 rounds) cuts (0.15, 4) at 150 > its R = 210: F_s' = its lowest smoothed loss
    # (1.2) is reached by every run at round 3 (mean of 2.0, 1.2, 1.2 = 1.47 > 1.2; round 4:
    # 1.2) -> all R = 4, the same for every run, which cannot identify A–D.
    calls: list = []
    fake = _fake_engine(calls)
    cfg = _config(
        None,
        ["planner.calibration=separate", "data.n_clients=4", "planner.calibration_rounds=150",
         "planner.calibration_fit=refuse"],
    )  # fmt: skip
    with pytest.raises(ConfigError, match="calibration"):
        prepare_proposed(cfg, tmp_path, run_one=fake, log=lambda m: None)
    assert len(calls) == 4
    # the default fit (constrained) plans instead, with C and D at their stated floors
    constrained = cfg.replace(
        planner=dataclasses.replace(cfg.planner, calibration_fit="constrained")
    )
    prepare_proposed(constrained, tmp_path, run_one=fake, log=lambda m: None)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert set(plan["floors"]) == {"C", "D"} and plan["constants_fit"].startswith("constrained")
    a = np.array([0.1, 0.2, 0.3, 0.4])  # the fake clients.csv
    assert np.all(a / np.array(plan["q"]) <= 1 + 1e-9)  # max_weight = 1: a_n/q_n <= 1


def test_calibration_is_continued_when_the_cap_is_raised(tmp_path):
    # Cap 150: (0.15, 4) stops short of its R = 210 and the fallback cannot fit (see above).
    # Raising the cap to 300 continues that run from round 150 (not from 0) to R = 210; the
    # three runs that reached F_s are reused, and the constants come out exact.
    calls: list = []
    fake = _fake_engine(calls)
    cfg = _config(
        None,
        ["planner.calibration=separate", "data.n_clients=4", "planner.calibration_rounds=150",
         "planner.calibration_fit=refuse"],
    )  # fmt: skip
    with pytest.raises(ConfigError, match="calibration"):
        prepare_proposed(cfg, tmp_path, run_one=fake, log=lambda m: None)
    calls.clear()
    raised = _config(
        None, ["planner.calibration=separate", "data.n_clients=4", "planner.calibration_rounds=300"]
    )
    prepare_proposed(raised, tmp_path, run_one=fake, log=lambda m: None)
    assert calls == [("resume", 0.15, 4, 300)]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [r["rounds"] for r in plan["calibration"]["runs"]] == [112, 120, 140, 210]
    assert [r["reached"] for r in plan["calibration"]["runs"]] == [True] * 4
    c = plan["constants"]
    assert [c["A"], c["C"], c["D"]] == pytest.approx([105, 0.05, 0.0125], rel=1e-9)
    sub = tmp_path / "calibration" / "run-3-q0.15-k4"
    assert _config(sub / "config.toml").training.rounds == 300


def test_calibration_loss_fraction_sets_f_s(tmp_path):
    # F_s = 0.7 x 2.0 = 1.4: the smoothed loss (2.0, 1.6, 1.47, 1.2 ...) is <= 1.4 at round 4
    # in every run, so all R = 4 -> the fit is refused; plan.json is not written
    calls: list = []
    fake = _fake_engine(calls)
    cfg = _config(
        None,
        [
            "planner.calibration=separate",
            "planner.calibration_fit=refuse",
            "data.n_clients=4",
            "planner.calibration_loss_fraction=0.7",
        ],
    )
    with pytest.raises(ConfigError, match="calibration"):
        prepare_proposed(cfg, tmp_path, run_one=fake, log=lambda m: None)
    for sub in sorted((tmp_path / "calibration").iterdir()):
        assert len((sub / "metrics.jsonl").read_text().splitlines()) == 1 + 4
    for bad in (0, 1, 1.5, -0.1):
        with pytest.raises(ConfigError, match=r"planner.calibration_loss_fraction"):
            _config(None, [f"planner.calibration_loss_fraction={bad}"])


def test_plan_outcome_compares_predicted_and_observed_rounds(tmp_path):
    # F_s' = 1.0; training losses 2.0, 1.2, 0.6, 0.3: smoothed 2.0, 1.6, 1.27, 0.7 -> R = 4
    plan = {
        "q": [0.5],
        "k": [4],
        "expected_rounds": 3.5,
        "degeneracy": {"degenerate": True, "reasons": ["every k_n = 1"]},
        "fit": [{"observed_rounds": 5.0, "predicted_rounds": 4.0}],
        "calibration": {
            "loss_used": 1.0,
            "sim_time_s": 12.5,
            "runs": [{"q": 0.3, "k": 4, "reached": False}],
        },
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    lines = [{"round": 0, "sim_time_s": 12.5, "train_loss": None}]
    lines += [{"round": r, "sim_time_s": 12.5 + r, "train_loss": x}
              for r, x in enumerate([2.0, 1.2, 0.6, 0.3], 1)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = plan_outcome(tmp_path)
    assert out["predicted_rounds"] == 3.5 and out["observed_rounds"] == 4
    assert out["rounds_run"] == 4 and out["loss_used"] == 1.0
    assert out["degenerate"] is True and out["degenerate_reasons"] == ["every k_n = 1"]
    assert out["calibration"] == [
        {"q": 0.3, "k": 4, "observed_rounds": 5.0, "predicted_rounds": 4.0, "reached_f_s": False}
    ]
    assert out["calibration_sim_time_s"] == 12.5
    assert plan_outcome(tmp_path / "nothing") is None


@pytest.mark.parametrize(("in_budget", "budget_s"), [("true", 10.0), ("false", 10.0 + 582)])
def test_calibration_in_budget_or_after_it(tmp_path, in_budget, budget_s):
    # the fake calibration takes 112 + 120 + 140 + 210 = 582 simulated seconds
    fake = _fake_engine([])
    cfg = _config(
        None, ["planner.calibration=separate", "data.n_clients=4", "planner.calibration_rounds=300",
               "training.time_budget_s=10",
               f"planner.calibration_in_budget={in_budget}", "method.name=proposed"],
    )  # fmt: skip
    planned, plan = prepare_proposed(cfg, tmp_path, run_one=fake, log=lambda m: None)
    assert plan.calibration_s == 582 and planned.training.time_budget_s == budget_s
    with pytest.raises(ConfigError, match="planner.calibration_in_budget = 1 is invalid"):
        _config(None, ["planner.calibration_in_budget=1"])


def _never(*args, **kwargs):
    raise AssertionError("no calibration run expected")


def test_prepare_proposed_uses_a_given_plan_file(tmp_path):
    plan = tmp_path / "my_plan.json"
    plan.write_text(json.dumps({"q": [0.5, 0.5], "k": [2, 4]}))
    cfg = _config(
        None, ["data.n_clients=2", "method.name=proposed", f'method.q="{plan}"',
               f'method.k="{plan}"', "lora.rank=4"],
    )  # fmt: skip
    assert prepare_proposed(cfg, tmp_path / "run", run_one=_never) == (cfg, None)
    method = make_method(cfg, np.array([0.5, 0.5]), np.random.default_rng(0))
    np.testing.assert_array_equal(method.k, [2, 4])


def test_nonnegative_constants_fallback():
    from fedlora.federation.calibration_plan import nonnegative_constants
    from fedlora.system.planner import Observation

    a = np.array([0.1, 0.2, 0.3, 0.4])

    def obs(rounds: dict) -> list:
        return [Observation(np.full(4, q), np.full(4, k), r) for (q, k), r in rounds.items()]

    # consistent data: the known constants exactly
    c = nonnegative_constants(obs(KNOWN_R), 16, a)
    assert [c.A, c.B, c.C, c.D] == pytest.approx([105, 1, 0.05, 0.0125], rel=1e-9)
    # smaller sketches needing fewer rounds (the unconstrained fit has D < 0): D at its floor
    faster = {(0.3, 16): 5, (0.15, 16): 5, (0.3, 4): 3, (0.15, 4): 5}
    c = nonnegative_constants(obs(faster), 16, a)
    assert c.A > 0 and c.C > 0
    assert c.D == pytest.approx(1e-9 * max(c.A, c.C))
