"""The planning problem and its PROBLEM.json structure (fedlora.system.planner.problem,
.schema): round trip, and bad fields named by their path."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedlora.config import NetworkConfig, PlannerConfig
from fedlora.errors import ConfigError
from fedlora.system.planner import (
    PlanOptions,
    plan,
    problem_from_dict,
)
from planner_cases import raw_problem


def test_plan_options_defaults_match_the_config_defaults():
    # one deliberate difference: a run bounds a_n/q_n by 1 (issue 21: a rarely sampled client
    # made a seed diverge); the library and `fedlora plan` leave it to the user (0 = none)
    from_config = PlanOptions.from_config(PlannerConfig(), NetworkConfig())
    assert from_config.max_weight == 1.0 and PlanOptions().max_weight == 0.0
    assert dataclasses.replace(from_config, max_weight=0.0) == PlanOptions()


def test_problem_from_dict_round_trip():
    p, o = problem_from_dict(raw_problem())
    assert p.n == 2 and p.gamma == 16 and o.comm_cost == "quadratic"
    assert plan(p, o).to_dict().keys() >= {
        "q",
        "k",
        "objective",
        "expected_round_time_s",
        "expected_rounds",
        "constants",
        "iterations",
        "solver",
    }


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"gamma": 0}, r"gamma = 0 is invalid: an integer >= 1"),
        ({"gamma": 16.0}, r"gamma = 16.0 .*without a decimal point"),
        ({"f_tot": 0}, r"f_tot = 0 is invalid: must be a finite number > 0"),
        ({"clients": []}, r"clients = \[\] is invalid: at least one client"),
        ({"constants": {"A": 1, "B": 1, "C": -0.01, "D": 0.001}}, r"constants.C = -0.01 .*> 0"),
        ({"constants": {"A": 0, "B": 1, "C": 0.01, "D": 0.001}}, r"constants.A = 0 .*> 0"),
        ({"constants": {"A": 1, "B": 1, "C": 0.01}}, r"constants lacks D"),
        ({"constants": None}, r"exactly one of constants .* or calibration"),
        ({"gama": 16}, r"unknown key 'gama' \(did you mean 'gamma'\?\)"),
        ({"options": {"solver": "cvx"}}, r"options.solver = 'cvx' .*exact, cvxpy"),
        ({"options": {"q_lower_bound": "x"}}, r"options.q_lower_bound = 'x'"),
        ({"options": {"m_serch": "grid"}}, r"unknown key 'm_serch' \(did you mean 'm_search'\?\)"),
        ({"options": {"grid_eps": -1}}, r"options.grid_eps = -1"),
        ({"options": {"rho": 2}}, r"options.rho = 2 .*\[0, 1\]"),
    ],
)
def test_bad_problem_fields(changes, pattern):
    with pytest.raises(ConfigError, match=pattern):
        problem_from_dict(raw_problem(**changes))


@pytest.mark.parametrize(
    ("field", "value"), [("tau_full_s", 0.0), ("t_full", -1.0), ("a", 0.0), ("t_full", "x")]
)
def test_bad_client_times_and_weights_name_the_client(field, value):
    raw = raw_problem()
    raw["clients"][1][field] = value
    with pytest.raises(ConfigError, match=rf"clients\[1\]\.{field} = .* must be finite and > 0"):
        problem_from_dict(raw)


def test_weights_not_summing_to_1_are_refused_unless_normalisation_is_asked():
    raw = raw_problem()
    raw["clients"][0]["a"] = 1.5
    with pytest.raises(ConfigError, match=r"a sum to 2, not 1 .*normalize_a"):
        problem_from_dict(raw)
    p, _ = problem_from_dict(raw, overrides={"normalize_a": True})
    np.testing.assert_allclose(p.a, [0.75, 0.25])


def test_bad_calibration_entries():
    cal = [{"q": [1.0, 1.0], "k": [16, 16], "rounds": 10}] * 4
    for bad, pattern in (
        ({"q": [1.0, 1.5], "k": [16, 16], "rounds": 10}, r"calibration\[0\].q\[1\] = 1.5"),
        (
            {"q": [1.0, 1.0], "k": [16, 17], "rounds": 10},
            r"calibration\[0\].k\[1\] = 17 .*1\.\.gamma",
        ),
        ({"q": [1.0, 1.0], "k": [16, 2.5], "rounds": 10}, r"calibration\[0\].k = .*integers"),
        ({"q": [1.0], "k": [16], "rounds": 10}, r"calibration\[0\]: q has 1 .*expected 2"),
        ({"q": [1.0, 1.0], "k": [16, 16], "rounds": 0}, r"calibration\[0\].rounds = 0"),
        ({"q": [1.0, 1.0], "k": [16, 16]}, r"calibration\[0\] = .*rounds"),
    ):
        with pytest.raises(ConfigError, match=pattern):
            problem_from_dict(raw_problem(constants=None, calibration=[bad] + cal[1:]))
