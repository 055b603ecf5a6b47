"""P2 and its pieces (fedlora.system.planner.objective), by hand; `plan_degeneracy`."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedlora.system.planner import (
    PlanOptions,
    PlanProblem,
    p2_objective,
    plan_degeneracy,
    q_lower_bounds,
    sketched_round_weights,
)
from planner_cases import CONSTANTS, QUAD, one_client


def test_sketched_round_weights_apply_the_cost_model_once():
    # Prepare: t_full/f_tot = 2 s, τ_full = 3 s, k = 8 of γ = 16
    p = PlanProblem(
        gamma=16, f_tot=10.0, a=[1.0], tau_full_s=[3.0], t_full=[20.0], constants=CONSTANTS
    )
    k = np.array([8])
    cases = {
        ("quadratic", "quadratic", 0.0): 2 * 0.25 + 3 * 0.25,
        ("linear", "linear", 0.0): 2 * 0.5 + 3 * 0.5,
        ("exact", "affine", 0.5): 2 * 0.5 + 3 * (0.5 + 0.5 * 0.5),
    }
    for (comm, comp, rho), expected in cases.items():
        o = PlanOptions(comm_cost=comm, comp_cost=comp, rho=rho)
        assert sketched_round_weights(p, k, o)[0] == pytest.approx(expected)


def test_q_lower_bounds_per_client_paper_and_none_by_hand():
    # a = (0.6, 0.4), N = 2, B = 1, C = 0.01, D = 0.001, γ = 4, k = (4, 2)
    p = PlanProblem(
        gamma=4, f_tot=1.0, a=[0.6, 0.4], tau_full_s=[1, 1], t_full=[1, 1], constants=CONSTANTS
    )
    k = np.array([4, 2])
    per_client = [0.36 * 2 * (0.01 + 0.001), 0.16 * 2 * (0.01 + 0.001 * 4)]
    paper = [0.36 * 2 * (0.01 + 0.001 * 4), 0.16 * 2 * (0.01 + 0.001 * 4)]  # K² = 4
    np.testing.assert_allclose(q_lower_bounds(p, CONSTANTS, k, "per_client"), per_client)
    np.testing.assert_allclose(q_lower_bounds(p, CONSTANTS, k, "paper"), paper)
    np.testing.assert_array_equal(q_lower_bounds(p, CONSTANTS, k, "none"), [0, 0])


def test_p2_objective_by_hand_and_inf_when_target_unreachable():
    p = one_client()
    # k = γ: c = 0.011; R = 1/(1 − 0.011/0.5) ; w = 10/10 + 1 = 2; E[T] = 0.5·2
    assert p2_objective(p, CONSTANTS, np.array([0.5]), np.array([4]), QUAD) == pytest.approx(
        1 / (1 - 0.022) * 1.0
    )
    assert p2_objective(p, CONSTANTS, np.array([0.005]), np.array([4]), QUAD) == math.inf


def test_plan_degeneracy_flags_all_k_one_and_q_at_bounds():
    # a = (0.6, 0.4), N = 2, γ = 4: per-client lo at k = (1, 1) is a²·2·(C + 16 D)
    p = PlanProblem(
        gamma=4, f_tot=1.0, a=[0.6, 0.4], tau_full_s=[1, 1], t_full=[1, 1], constants=CONSTANTS
    )
    opts = PlanOptions(q_lower_bound="per_client")
    lo = [0.36 * 2 * 0.026, 0.16 * 2 * 0.026]
    d = plan_degeneracy(p, CONSTANTS, [lo[0], 1.0], [1, 1], opts)
    assert d["degenerate"] and d["reasons"] == [
        "every k_n = 1",
        "every q_n at a bound (lower bound or 1)",
    ]
    assert (d["k_at_1"], d["k_at_gamma"], d["q_at_lower_bound"], d["q_at_1"]) == (2, 0, 1, 1)
    fine = plan_degeneracy(p, CONSTANTS, [0.5, 1.0], [4, 2], opts)
    assert not fine["degenerate"] and fine["reasons"] == []
    assert (fine["k_at_gamma"], fine["q_at_1"], fine["q_at_lower_bound"]) == (1, 1, 0)
    # only one of the two: still degenerate, with its reason
    only_k = plan_degeneracy(p, CONSTANTS, [0.5, 0.7], [1, 1], opts)
    assert only_k["reasons"] == ["every k_n = 1"]
    # no lower bound: only q = 1 counts as a bound
    none = plan_degeneracy(p, CONSTANTS, [lo[0], 1.0], [4, 4], PlanOptions(q_lower_bound="none"))
    assert not none["degenerate"] and none["q_at_lower_bound"] == 0
